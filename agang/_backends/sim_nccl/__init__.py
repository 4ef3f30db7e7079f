"""A simulated NCCL on the CPU: simulated devices (streams, events, kernels, NCCL's
completion, abort and watchdog), communicators over them as duck-typed process groups,
and, across processes, a wire (Gloo) that meets the other processes' parts and a c10d
backend (``agang_sim_nccl``) that makes them. ``agang.testing.SimulatedNccl`` runs every
rank in one process; ``agang.init`` under ``AGANG_SIM_NCCL=1`` makes one rank per
process. It stands behind the backend seam as a stand-in for CUDA and NCCL, which is
why it lives here and not with the testing tools: set-up selects it."""
