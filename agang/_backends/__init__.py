"""Backends: the communicators a gang's engine drives, behind one contract.

- :mod:`agang._backends.contract`: the ``Backend`` protocol, the whole contract.
- :mod:`agang._backends.c10d`: c10d process groups (Gloo, NCCL), with
  :mod:`~agang._backends.c10d_order` (order checks), :mod:`~agang._backends.c10d_blame` (blame),
  :mod:`~agang._backends.c10d_children` (sub-gangs, lanes),
  :mod:`~agang._backends.c10d_abort` (ending Gloo work), :mod:`~agang._backends.c10d_waiter`
  (Work without a future), :mod:`~agang._backends.c10d_peers` (naming a lost peer) and
  :mod:`~agang._backends.cuda_completion` (learning that an NCCL op finished).
- :mod:`agang._backends.fake`: ``FakeGang``'s one-process simulation.

FakeWorld's backend lives with the testing tools (``agang.testing._world_backend``).
"""
