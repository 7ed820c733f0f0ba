"""Starting and ending one rank's membership of the tensor-parallel process group.

gloo on CPUs, NCCL on GPUs (each rank its own device, ``cuda:RANK`` of what CUDA_VISIBLE_DEVICES
shows). The rendezvous is a file in a folder only the engine core and its workers know (no port to
pick, nothing listening beyond what gloo itself opens); gloo is held to the loopback interface
unless GLOO_SOCKET_IFNAME says otherwise, since every rank runs on this host. On CPUs the layers'
collectives go through shared memory (shm.py) where they fit, gloo otherwise.

On a CPU each rank runs one torch thread pinned to its own core (the ranks' GEMMs would otherwise
fight over the same cores and every collective would wait for the slowest); ``pin`` returns what
it changed so an engine made in a caller's process can give it back.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from backend.attention.cpu_kernel.build import KernelUnavailable, load_kernel
from backend.parallel.shard import TensorShard
from backend.parallel.shm import ShmCollectives

logger = logging.getLogger(__name__)

# How long a rank waits in one collective (or for the others to join) before it gives up; a step's
# ranks meet within milliseconds, so this only bounds a rank that will never come.
COLLECTIVE_TIMEOUT_SECONDS = 120


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Where ``rank`` computes: its own GPU, or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def join(rank: int, size: int, rendezvous_file: str, device: torch.device, shm_file: str | None = None,
         peer_pids: list[int] | None = None) -> TensorShard:
    """Joins the group (blocks until every rank has); returns this rank's shard. On CPUs with
    ``shm_file`` (made by rank 0, see shm.py) the collectives go through shared memory where the
    CPU kernels load, gloo otherwise; ``peer_pids`` are the processes whose death ends a wait."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{rendezvous_file}",
                            rank=rank, world_size=size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS))
    shm = None
    if device.type == "cpu" and shm_file is not None:
        try:
            shm = ShmCollectives(shm_file, rank, size, peer_pids or [0] * size, load_kernel())
        except KernelUnavailable as exc:
            logger.warning("tensor-parallel collectives go through gloo: %s", exc)
    return TensorShard(rank, size, dist.group.WORLD, shm=shm)


def leave(shard: TensorShard | None = None) -> None:
    if shard is not None and shard.shm is not None:
        shard.shm.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def pin(rank: int, cores: list[int]) -> tuple[set[int], int]:
    """Runs this process on one of the group's ``cores`` (rank modulo their count: the cores rank 0
    could use before anyone was pinned) with one torch thread; returns (the previous affinity, the
    previous thread count)."""
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    return before


def unpin(before: tuple[set[int], int]) -> None:
    os.sched_setaffinity(0, before[0])
    torch.set_num_threads(before[1])
