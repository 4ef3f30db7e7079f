"""``agang selfcheck``: agang's NCCL paths checked on GPUs, or on the simulation."""
