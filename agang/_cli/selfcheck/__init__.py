"""``agang selfcheck``: checks that what agang promises on NCCL holds on this machine: on
its GPUs, or, without one, on the simulated NCCL of ``agang.testing``.

The checks are written once against a harness: real NCCL ranks (one per process,
through ``agang.init``) or every rank of the simulation in this process. Each rank's
results are merged into one table, and the command's exit status says whether all
passed.
"""
