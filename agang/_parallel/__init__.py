"""Parallel layouts: bundles of gangs (data, tensor, pipeline...), the grids that make
them, and the two-way bridge to PyTorch's ``DeviceMesh``."""
