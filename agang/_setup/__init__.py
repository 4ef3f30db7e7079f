"""Set-up: everything that happens before a process has its root gang.

Set-up reads the world from the launcher, meets the other ranks at a TCP store, makes
the process group and proves it with a barrier, all within one deadline and off the
caller's event loop. Its modules:

- :mod:`agang._setup.env`: the world (rank, size, store address) from torchrun's or
  SLURM's environment variables.
- :mod:`agang._setup.device`: the gang's device and c10d backend.
- :mod:`agang._setup.rendezvous`: the store (hosted or connected to) and the check-in
  that names every rank that never came.
- :mod:`agang._backends.c10d.retry`: which failures are transient (a type, decided where c10d is
  called) and the user's retry policy, always bounded by the deadline.
- :mod:`agang._setup.init`: ``agang.init`` and ``agang.init_sync``, which plan, run the
  above on a daemon thread and turn any failure into a ``GangInitError``.
"""
