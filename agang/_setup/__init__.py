"""Set-up: everything that happens before a process has its root gang, and again each
time an elastic gang is re-formed.

Set-up reads the world from the launcher, prepares the process, meets the other ranks
at a TCP store, makes the process group and proves it with a barrier, all within one
deadline and off the caller's event loop; a failure becomes a ``GangInitError`` that
names what went wrong. It makes gangs, so it sits above them: it imports from the
backends, the gangs and the runtime below it, never from the commands (``_cli``) or
``agang.testing``.

In the order set-up runs:

- ``agang._setup.env``: the launchers agang knows, as one table, and the world
  (rank, size, store address) read from their variables.
- ``agang._setup.process``: the device and c10d backend, and what the process is set
  up with before its group exists (NCCL's settings, as a table the doctor reads too).
- ``agang._setup.interface``: the network interface the ranks' connections use.
- ``agang._setup.rendezvous``: the store, the check-in that names every rank that
  never came, and the barrier that proves the new group.
- ``agang._setup.init``: ``agang.init`` and ``agang.init_sync``, which plan, run the
  above on a daemon thread and turn any failure into a ``GangInitError``.
- ``agang._setup.membership``, ``agang._setup.elastic`` and
  ``agang._setup.elastic_gang``: an elastic gang's epochs, who belongs to each, and
  the gang re-formed from its survivors and joiners.
"""
