"""``SimulatedNccl`` (every rank in one process) and the switch to the simulation across
processes (``use_simulated_nccl``); the simulation itself is ``agang._backends.sim_nccl``."""
