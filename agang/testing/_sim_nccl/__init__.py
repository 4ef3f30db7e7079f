"""``SimulatedNccl``: NCCL's completion and abort behaviour on a CPU, so the real CUDA
completion path runs in tests: the device, the communicator group and the kernels."""
