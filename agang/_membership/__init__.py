"""Membership: what elastic gangs and the weights channel share, below both.

Both features keep who belongs to each epoch in a store that outlives every member (an
``agang store``), and both must tell a live member from a dead or stopped one without
trusting any clock but the reader's own. Each keeps its own *decider*: an elastic reform
is leaderless (the first member to write the list wins), a weights round is led by its
publisher. What they decide with is here, once:

- ``agang._membership.store``: connecting to the store (retried within a deadline,
  failing with an error that names the store and the feature that asked), and reading
  a key that may be missing without waiting for it.
- ``agang._membership.member``: the member record (an id, a name, where it runs).
- ``agang._membership.roster``: each epoch's members, the pointer to the newest
  epoch, and the members' check-ins.
- ``agang._membership.heartbeat``: a member's beat (a count, never a time), the
  thread that raises it, and the reader's judgement of who is silent, on its own
  monotonic clock.
- ``agang._membership.deaths``: death notices, what any watcher (a launcher, Ray,
  a test) says of a member it saw die; both features act on them at once.

It sits below set-up and the weights, above the backends (the c10d store and its log).
"""
