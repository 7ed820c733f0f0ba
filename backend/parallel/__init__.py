"""Tensor parallelism: the engine core as rank 0 of a group of model workers (torch.distributed:
gloo on CPUs, NCCL on GPUs).

- shard.py: what one rank holds of each layer (the sharding rule, checkpoint slicing) and the
  collectives the layers call;
- group.py: starting and ending the process group (rendezvous, backend, affinity);
- driver.py: rank 0's side: starts the workers, hands them each step's plan, watches them.

The workers' process (ranks 1..N-1, a ModelRunner each) is backend/runner/tp_worker.py: it runs the
runner, which imports this package, so it lives above it.

docs/architecture.md ("Tensor parallelism") has the data flow and why each choice was made.
"""
