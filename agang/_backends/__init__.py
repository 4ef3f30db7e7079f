"""Backends: what a gang's engine drives to move bytes, and the one contract it drives
them through.

The contract (``contract``: the ``Backend`` protocol and its vocabulary) and the order
check's fingerprint format (``fingerprint``) are the seam: the engine above and every
backend below speak them, and nothing else crosses it. Behind the seam stand the
backends themselves: c10d process groups (``c10d/``: Gloo and NCCL), what the NCCL path
needs of a CUDA device (``cuda/``), and ``FakeGang``'s one-process simulation (``fake``).
FakeWorld's backend lives with the testing tools (``agang.testing``).

Nothing here imports the engine, the gangs or set-up: a backend knows only the contract.
"""
