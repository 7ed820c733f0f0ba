"""The CPU emulation harness itself: CUDA built-ins, and the rule breaks it must report.

Runs tests/kernels/probe_kernels.cu. Without these the kernel tests could pass for the wrong
reason: a barrier that does not check call sites, a shuffle that ignores its mask, shared memory
that happens to be zero, a conversion that truncates instead of rounding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.build_options import ModuleSpec
from kernels.emulation import EmulatedKernelError, EmulatedModule, build_emulated
from tests.kernels import cases

PROBE = Path(__file__).with_name("probe_kernels.cu")


@pytest.fixture(scope="module")
def probe() -> EmulatedModule:
    spec = ModuleSpec("probe_kernels.cu", (), ())
    return EmulatedModule(build_emulated(spec, cases.VARIANT, PROBE.read_text()))


def test_index_variables(probe):
    grid, block = (2, 3, 1), (4, 2, 2)
    out = torch.full((6 * 16 * 12,), -1, dtype=torch.int32)
    probe.get_function("index_variables")(grid, block, (out,))
    rows = out.view(6, 16, 12)
    for bz in range(1):
        for by in range(3):
            for bx in range(2):
                for tz in range(2):
                    for ty in range(2):
                        for tx in range(4):
                            row = rows[bx + 2 * (by + 3 * bz), tx + 4 * (ty + 2 * tz)].tolist()
                            assert row == [tx, ty, tz, bx, by, bz, *block, *grid]


@pytest.mark.skipif(cases.VARIANT == "asan", reason="under ASan __shared__ is plain static storage")
def test_shared_memory_is_refilled_before_every_block(probe):
    out = torch.zeros(3)
    probe.get_function("read_shared_unwritten")((3,), (64,), (out,))
    pattern = np.frombuffer(b"\x7f\x7f\x7f\x7f", dtype=np.float32)[0]
    assert out.tolist() == [pytest.approx(float(pattern))] * 3


def test_shuffles(probe):
    out = torch.zeros(64 * 3, dtype=torch.int32)
    probe.get_function("shuffles")((1,), (64,), (out,))
    got = out.view(64, 3).tolist()
    for t in range(64):
        base, lane = t - t % 32, t % 32
        assert got[t] == [base + (lane ^ 5), base + 3, t + 4 if lane + 4 < 32 else t]


def test_syncthreads_at_different_call_sites_is_reported(probe):
    with pytest.raises(EmulatedKernelError, match="while other threads wait at line"):
        probe.get_function("divergent_syncthreads")((1,), (64,), (torch.zeros(64),))


def test_return_while_others_wait_at_syncthreads_is_reported(probe):
    with pytest.raises(EmulatedKernelError, match="__syncthreads|returned from the kernel"):
        probe.get_function("early_return")((1,), (64,), (torch.zeros(64),))


def test_shuffle_mask_without_every_lane_is_reported(probe):
    with pytest.raises(EmulatedKernelError, match="mask 0x0000ffff"):
        probe.get_function("partial_mask_shuffle")((1,), (32,), (torch.zeros(32),))


def test_lanes_of_one_warp_at_different_shuffles_are_reported(probe):
    with pytest.raises(EmulatedKernelError, match="__shfl_xor_sync"):
        probe.get_function("warp_split_shuffle")((1,), (64,), (torch.zeros(64),))


def _conversion_inputs() -> torch.Tensor:
    every_half = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    finite = every_half[every_half.isfinite()].unique()  # sorted
    ties = (finite[:-1].double() + finite[1:].double()) / 2  # exact midpoints: round to even
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (50_000,), generator=g, dtype=torch.int64).to(
        torch.int32
    )
    random_floats = random_bits.view(torch.float32)
    specials = torch.tensor(
        [
            65504.0,
            65519.99,
            65520.0,
            65536.0,
            1e-8,
            -1e-8,
            2.0**-25,
            2.0**-24,
            3e38,
            float("inf"),
            -float("inf"),
        ]
    )
    return torch.cat([every_half, ties.float(), random_floats, specials, -specials]).contiguous()


def test_half_and_bfloat16_conversions_round_to_nearest_even(probe):
    x = _conversion_inputs()
    n = x.numel()
    half_out, bf16_out = torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.bfloat16)
    half_back, bf16_back = torch.empty(n), torch.empty(n)
    probe.get_function("conversions")(
        (8,), (128,), (x, half_out, half_back, bf16_out, bf16_back, np.int32(n))
    )
    nan = x.isnan()
    assert torch.equal(half_out[~nan].view(torch.int16), x[~nan].half().view(torch.int16))
    assert torch.equal(bf16_out[~nan].view(torch.int16), x[~nan].bfloat16().view(torch.int16))
    assert half_out[nan].isnan().all() and bf16_out[nan].isnan().all()
    assert torch.equal(half_back[~nan], half_out[~nan].float())
    assert torch.equal(bf16_back[~nan], bf16_out[~nan].float())


def test_arguments_of_the_wrong_dtype_are_rejected(probe):
    kernel = probe.get_function("scalar_arguments")
    out = torch.zeros(3)
    kernel((1,), (32,), (out, np.int32(3), np.int64(2**40), np.float32(0.5)))
    assert out.tolist() == [3.0, float(2**40), 0.5]
    with pytest.raises(TypeError, match="argument 1 must be a int32 scalar"):
        kernel((1,), (32,), (out, 3, np.int64(1), np.float32(0.5)))  # a Python int is int64, as in CuPy
    with pytest.raises(TypeError, match="argument 2 must be a int64 scalar"):
        kernel((1,), (32,), (out, np.int32(3), np.int32(1), np.float32(0.5)))
    with pytest.raises(TypeError, match="argument 3 must be a float32 scalar"):
        kernel((1,), (32,), (out, np.int32(3), np.int64(1), 0.5))  # a Python float is float64
    with pytest.raises(TypeError, match="argument 0 must be an array of float32, got float16"):
        kernel((1,), (32,), (out.half(), np.int32(3), np.int64(1), np.float32(0.5)))
    with pytest.raises(TypeError, match="takes 4 arguments"):
        kernel((1,), (32,), (out,))
