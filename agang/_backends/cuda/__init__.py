"""What the NCCL path needs of a CUDA device, with no c10d in it: streams, events and
the runtime seam that lets a simulated device stand in for a real one."""
