"""The backend over c10d process groups (Gloo on CPU, NCCL on CUDA): issuing, learning
that an op ended, order checks, blame, sub-gangs, abort and what a fork must forget."""
