"""``agang doctor``: checks a job's environment and this host before ``agang.init`` runs.

The checks are pure functions of plain data (the environment, this host's facts, a
network probe), so tests drive them without a real job. Its modules:

- :mod:`agang._cli.doctor.diagnose`: the entry point, :func:`~agang._cli.doctor.diagnose.diagnose`,
  and the checks of the world itself (launcher variables, local ranks, threads).
- :mod:`agang._cli.doctor.host`: what this host's torch build and hardware offer (Gloo, NCCL,
  CUDA), probed once and checked.
- :mod:`agang._cli.doctor.network`: whether the ranks can meet at the store's address and
  port.
- :mod:`agang._cli.doctor.links`: this host's interfaces, up or down, and their networks (to
  name the one toward MASTER_ADDR).
- :mod:`agang._cli.doctor.findings`: the findings, and their rendering as text or JSON.
"""
