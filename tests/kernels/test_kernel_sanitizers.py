"""The kernel tests again under ThreadSanitizer and under AddressSanitizer + UBSan, and two
planted bugs that the harness must catch.

Each run is a subprocess: ``python -m pytest`` on the kernel test files with the sanitizer's
runtime in LD_PRELOAD (it must be loaded before anything else) and KERNEL_EMULATION_VARIANT set,
so the same tests load libraries built with -fsanitize (tests/kernels/cases.py trims the
configurations to the ones that matter for races and out-of-bounds accesses). The libraries are
built here first, without the sanitizer runtime in the compiler's environment.

Planted bugs (tests/kernels/planted_bugs.py), proving the harness catches what it claims to:
  * missing_sync: one __syncthreads removed -> ThreadSanitizer reports a data race;
  * read_past_context: the decode loop reads one token past the context -> AddressSanitizer reports
    a heap-buffer-overflow (full last block-table row), and the plain build's NaN-poisoned cache
    turns the output into NaN.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.build_options import paged_attention_spec
from kernels.emulation import build_emulated, build_many, sanitizer_runtime
from tests.kernels import cases, planted_bugs, reference
from tests.kernels.batches import make_batch
from tests.kernels.conftest import emulated_module
from tests.kernels.test_paged_attention_kernel import run_decode

REPO = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/kernels/test_paged_attention_kernel.py",
    "tests/kernels/test_reshape_and_cache_kernel.py",
    "tests/kernels/test_cupy_backend_emulated.py",
    "tests/kernels/test_lora_bgmv_emulated.py",
]
SANITIZER_ENV = {
    "tsan": {"TSAN_OPTIONS": "halt_on_error=1 exitcode=66 report_signal_unsafe=0"},
    "asan": {
        "ASAN_OPTIONS": "detect_leaks=0 halt_on_error=1 exitcode=67",
        "UBSAN_OPTIONS": "print_stacktrace=1 halt_on_error=1",
    },
}
REPORT = {"tsan": "WARNING: ThreadSanitizer", "asan": "ERROR: AddressSanitizer"}
PLANTED_TEST = (
    "tests/kernels/test_paged_attention_kernel.py::test_decode_matches_reference[float16-h128-p64-{}]"
)

pytestmark = pytest.mark.skipif(cases.SANITIZER_RUN, reason="already inside a sanitizer run")


def _sanitized_specs(variant: str):
    saved = os.environ.get("KERNEL_EMULATION_VARIANT")
    cases_variant, cases.VARIANT, cases.SANITIZER_RUN = cases.VARIANT, variant, True
    try:
        from tests.kernels.conftest import all_emulated_specs

        return all_emulated_specs()
    finally:
        cases.VARIANT, cases.SANITIZER_RUN = cases_variant, False
        if saved is not None:
            os.environ["KERNEL_EMULATION_VARIANT"] = saved


def _prepare(variant: str, bug: str | None) -> tuple[list[str], dict[str, str]]:
    """Builds the libraries of a run (outside the sanitizer) and returns its command and env."""
    runtime = sanitizer_runtime(variant)
    if runtime is None:
        pytest.skip(f"g++ has no {variant} runtime (g++ -print-file-name); install gcc's libtsan/libasan")
    if bug is None:
        build_many((spec, variant) for spec in _sanitized_specs(variant))
    else:
        spec = paged_attention_spec("float16", 128, partition_size=64)
        build_emulated(spec, variant, planted_bugs.apply(bug, spec.source, spec.code()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "KERNEL_PLANTED_BUG"}
    env.update(SANITIZER_ENV[variant], LD_PRELOAD=runtime, KERNEL_EMULATION_VARIANT=variant)
    # torch's own OpenMP threads synchronise inside libgomp, which ThreadSanitizer cannot see:
    # one thread keeps its reports about our kernels only.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if bug is not None:
        env["KERNEL_PLANTED_BUG"] = bug
    # --capture=sys: the sanitizer writes its report to file descriptor 2, which must stay ours.
    return [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--capture=sys"], env


# test name -> (sanitizer, pytest arguments, planted bug)
RUNS: dict[str, tuple[str, list[str], str | None]] = {
    "test_kernel_tests_pass_under_thread_sanitizer": ("tsan", KERNEL_TESTS, None),
    "test_kernel_tests_pass_under_address_and_undefined_behaviour_sanitizers": ("asan", KERNEL_TESTS, None),
    "test_thread_sanitizer_catches_a_missing_syncthreads": (
        "tsan",
        [PLANTED_TEST.format("lens1-16-33_full_row")],
        "missing_sync",
    ),
    "test_address_sanitizer_catches_a_read_past_the_context": (
        "asan",
        [PLANTED_TEST.format("gqa4_multiple_of_block")],
        "read_past_context",
    ),
}


@pytest.fixture(scope="module")
def sanitizer_runs(request) -> dict[str, subprocess.CompletedProcess | str]:
    """Runs the sanitizer subprocesses of the selected tests; test name -> CompletedProcess, or
    -> the reason to skip."""
    selected = [name for name in RUNS if any(item.name == name for item in request.session.items)]
    commands, results = {}, {}
    for name in selected:
        variant, tests, bug = RUNS[name]
        try:
            cmd, env = _prepare(variant, bug)
        except pytest.skip.Exception as exc:
            results[name] = str(exc)
            continue
        commands[name] = ([*cmd, *tests], env)
    # One at a time: the emulation's barriers are slow when its threads compete for the cores.
    for name, (cmd, env) in commands.items():
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        if "unexpected memory mapping" in proc.stdout + proc.stderr:  # TSan vs. high ASLR entropy: no ASLR
            proc = subprocess.run(
                ["setarch", platform.machine(), "-R", *cmd],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
        results[name] = proc
    return results


def _result(runs, name: str) -> subprocess.CompletedProcess:
    result = runs[name]
    if isinstance(result, str):
        pytest.skip(result)
    return result


def _tail(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout + proc.stderr)[-6000:]


@pytest.mark.slow
def test_kernel_tests_pass_under_thread_sanitizer(sanitizer_runs):
    proc = _result(sanitizer_runs, "test_kernel_tests_pass_under_thread_sanitizer")
    assert REPORT["tsan"] not in proc.stdout + proc.stderr, _tail(proc)
    assert proc.returncode == 0, _tail(proc)
    assert " passed" in proc.stdout, _tail(proc)


@pytest.mark.slow
def test_kernel_tests_pass_under_address_and_undefined_behaviour_sanitizers(sanitizer_runs):
    proc = _result(sanitizer_runs, "test_kernel_tests_pass_under_address_and_undefined_behaviour_sanitizers")
    output = proc.stdout + proc.stderr
    assert REPORT["asan"] not in output and "runtime error:" not in output, _tail(proc)
    assert proc.returncode == 0, _tail(proc)
    assert " passed" in proc.stdout, _tail(proc)


@pytest.mark.slow
def test_thread_sanitizer_catches_a_missing_syncthreads(sanitizer_runs):
    proc = _result(sanitizer_runs, "test_thread_sanitizer_catches_a_missing_syncthreads")
    assert proc.returncode != 0, _tail(proc)
    assert "ThreadSanitizer: data race" in proc.stderr, _tail(proc)
    assert "paged_attention.cu" in proc.stderr, _tail(proc)


@pytest.mark.slow
def test_address_sanitizer_catches_a_read_past_the_context(sanitizer_runs):
    proc = _result(sanitizer_runs, "test_address_sanitizer_catches_a_read_past_the_context")
    assert proc.returncode != 0, _tail(proc)
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, _tail(proc)
    assert "paged_attention_decode" in proc.stderr, _tail(proc)


def test_nan_poison_catches_a_read_past_the_context():
    """The plain build: the token after the context sits in a NaN slot of the cache."""
    batch = make_batch(
        [1, 16, 33], [1, 1, 1], num_heads=4, num_kv_heads=4, head_size=128, block_size=16, dtype=torch.float16
    )
    reference.write_cache(
        batch.key, batch.value, batch.key_cache, batch.value_cache, batch.metadata.slot_mapping
    )
    spec = paged_attention_spec("float16", 128, partition_size=64)
    args = (
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.metadata.block_tables,
        batch.metadata.seq_lens,
        0.1,
        64,
    )
    assert not run_decode(emulated_module(spec, "plain", None), *args).isnan().any()
    assert run_decode(emulated_module(spec, "plain", "read_past_context"), *args).isnan().any()
