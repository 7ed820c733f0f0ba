"""Tensor parallelism: the engine core as rank 0 of a group of model workers (torch.distributed:
gloo on CPUs, NCCL on GPUs).

- shard.py: what one rank holds of each layer (the sharding rule, checkpoint slicing) and the
  collectives the layers call;
- group.py: starting and ending the process group (rendezvous, backend, affinity);
- worker.py: the process of ranks 1..N-1 (``python -m backend.parallel.worker``);
- driver.py: rank 0's side: starts the workers, hands them each step's plan, watches them.

docs/architecture.md ("Tensor parallelism") has the data flow and why each choice was made.
"""
