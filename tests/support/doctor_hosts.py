"""Host facts for ``agang doctor``'s tests: a plain CPU machine, as data."""

from __future__ import annotations

from agang._cli.doctor.host import HostFacts

#: A CPU-only host with torch's Gloo and 8 CPUs, no CUDA.
CPU_HOST = HostFacts(
    torch_version="2.13.0+cpu",
    distributed_available=True,
    gloo_available=True,
    nccl_available=False,
    cuda_available=False,
    cuda_device_count=0,
    cuda_version=None,
    nccl_version=None,
    num_cpus=8,
)
