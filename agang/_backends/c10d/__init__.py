"""The backend over c10d process groups (Gloo on CPU, NCCL on CUDA): issuing the raw
calls, learning that an op ended, order checks on a side channel, each process's store
mailbox (blame), sub-gangs and lanes, abort, what a fork must forget, what set-up
learned about the world, the retries of c10d's transient failures, and c10d's C++ log
(kept quiet while a store is opened)."""
