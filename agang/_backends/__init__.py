"""Backends: the communicators a gang's engine drives, behind one contract.

- :mod:`agang._backends.contract`: the ``Backend`` protocol, the whole contract.
- :mod:`agang._backends.c10d.backend`: c10d process groups (Gloo, NCCL), with
  :mod:`~agang._backends.c10d.order` (order checks), :mod:`~agang._backends.c10d.mailbox` (blame),
  :mod:`~agang._backends.c10d.children` (sub-gangs, lanes),
  :mod:`~agang._backends.c10d.abort` (ending Gloo work), :mod:`~agang._backends.c10d.completion`
  (Work without a future), :mod:`~agang._backends.c10d.world` (naming a lost peer) and
  :mod:`~agang._backends.c10d.cuda_completion` (learning that an NCCL op finished).
- :mod:`agang._backends.fake`: ``FakeGang``'s one-process simulation.

FakeWorld's backend lives with the testing tools (``agang.testing._world.backend``).
"""
