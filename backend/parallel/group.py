"""Starting and ending one rank's membership of the tensor-parallel process group.

gloo on CPUs, NCCL on GPUs (each rank its own device, ``cuda:RANK`` of what CUDA_VISIBLE_DEVICES
shows). The rendezvous is a file in a folder only the engine core and its workers know (no port to
pick, nothing listening beyond what gloo itself opens); gloo is held to the loopback interface
unless GLOO_SOCKET_IFNAME says otherwise, since every rank runs on this host.

On a CPU each rank runs one torch thread pinned to its own core (the ranks' GEMMs would otherwise
fight over the same cores and every collective would wait for the slowest); ``pin`` returns what
it changed so an engine made in a caller's process can give it back.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from backend.parallel.shard import TensorShard

# How long a rank waits in one collective (or for the others to join) before it gives up; a step's
# ranks meet within milliseconds, so this only bounds a rank that will never come.
COLLECTIVE_TIMEOUT_SECONDS = 120


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Where ``rank`` computes: its own GPU, or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def join(rank: int, size: int, rendezvous_file: str, device: torch.device) -> TensorShard:
    """Joins the group (blocks until every rank has); returns this rank's shard."""
    import torch.distributed as dist  # noqa: PLC0415

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{rendezvous_file}",
                            rank=rank, world_size=size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS))
    return TensorShard(rank, size, dist.group.WORLD)


def leave() -> None:
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_initialized():
        dist.destroy_process_group()


def pin(rank: int) -> tuple[set[int], int]:
    """Runs this process on one core of those it may use (rank modulo their count) with one torch
    thread; returns (the previous affinity, the previous thread count)."""
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    cores = sorted(before[0])
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    return before


def unpin(before: tuple[set[int], int]) -> None:
    os.sched_setaffinity(0, before[0])
    torch.set_num_threads(before[1])
