"""``SimulatedNccl`` (every rank in one process, ``nccl``) and the switch to the simulation
across processes (``use_simulated_nccl``, ``processes``); the simulation itself is
``agang._backends.sim_nccl``."""
