"""The tensor-parallel ranks' shared-memory collectives (backend/parallel/shm.py), two ranks as two
threads of this process (the barrier releases the GIL): every rank gets the same sum, bit for bit,
as the slots added in rank order; rank 0 gets the gathered columns; a tensor past the slot is
refused by ``fits`` (the shard then uses gloo); a dead peer ends the wait with an error, not a hang.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
import torch

from backend.attention.cpu_kernel.build import KernelUnavailable, load_kernel
from backend.parallel.shm import CollectiveFailed, ShmCollectives, create_file


@pytest.fixture
def kernels():
    try:
        return load_kernel()
    except KernelUnavailable as exc:  # pragma: no cover - CI has g++
        pytest.fail(f"the CPU kernels must build here: {exc}")


def pair(kernels, slot_bytes=1 << 16, pids=(0, 0)):
    path = create_file(2, slot_bytes)
    ranks = [ShmCollectives(path, rank, 2, list(pids), kernels, slot_bytes) for rank in range(2)]
    os.unlink(path)
    return ranks


def run_both(calls):
    results, errors = [None, None], []

    def run(index):
        try:
            results[index] = calls[index]()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_gives_every_rank_the_same_sum_many_times(kernels, dtype):
    ranks = pair(kernels)
    gen = torch.Generator().manual_seed(0)
    for step in range(50):  # slots alternate: a rank racing ahead never overwrites what the other reads
        parts = [torch.randn(7 + step, 33, generator=gen).to(dtype) for _ in range(2)]
        tensors = [p.clone() for p in parts]
        run_both([lambda r=r, t=tensors: ranks[r].all_reduce(t[r]) for r in range(2)])
        expected = (parts[0].float() + parts[1].float()).to(dtype)
        assert torch.equal(tensors[0], tensors[1])
        assert torch.equal(tensors[0], expected)


def test_gather_columns_reaches_rank_0_only(kernels):
    ranks = pair(kernels)
    parts = [torch.full((4, 3), float(r + 1)) for r in range(2)]
    got = run_both([lambda r=r: ranks[r].gather_columns(parts[r]) for r in range(2)])
    assert got[1] is None and torch.equal(got[0], torch.cat(parts, dim=1))
    assert ranks[0].fits(torch.empty(1 << 14)) and not ranks[0].fits(torch.empty((1 << 14) + 1))


def test_a_dead_peer_ends_the_wait_with_an_error(kernels):
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid is no process now
    ranks = pair(kernels, pids=(0, gone.pid))
    started = time.monotonic()
    with pytest.raises(CollectiveFailed, match="a peer rank is gone"):
        ranks[0].all_reduce(torch.ones(8))
    assert time.monotonic() - started < 5
