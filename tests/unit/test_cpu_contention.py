"""perf.cpu_contention's table gives each policy and condition its medians and its rounds turn the
order around; perf.runtime_settings' ``passive`` setup sets OpenMP's wait policy in the child's
environment only."""

from __future__ import annotations

import os

import pytest

from perf.cpu_contention import check_policies, policy_environment, policy_overrides, round_order, table
from perf.runtime_settings import ALLOCATORS, setup_environment


def run(tok_s: float, stream_s: float, cpu_ms: float) -> dict:
    return {"decode_tok_s": tok_s, "stream_s": stream_s, "core_cpu_ms_per_token": cpu_ms, "tokens": 64}


def test_the_table_has_one_row_per_policy_and_condition_with_medians():
    results = {
        "default": {"alone": [run(50, 1.4, 30), run(40, 1.7, 35), run(60, 1.2, 28)],
                    "busy neighbor": [run(4, 16.0, 300), run(5, 13.0, 250), run(3, 21.0, 400)]},
        "passive": {"alone": [run(45, 1.5, 31)], "busy neighbor": [run(30, 2.2, 33)]},
    }
    rows = table(results).splitlines()
    assert rows[2] == "| default | alone | 50.0 | 1.40 | 30.0 |"
    assert rows[3] == "| default | busy neighbor | 4.0 | 16.00 | 300.0 |"
    assert rows[5] == "| passive | busy neighbor | 30.0 | 2.20 | 33.0 |"
    assert len(rows) == 6


def test_the_passive_setup_sets_the_wait_policy_that_the_default_setup_leaves_alone(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert setup_environment("passive")["OMP_WAIT_POLICY"] == "PASSIVE"
    assert setup_environment("spin1k")["GOMP_SPINCOUNT"] == "1000"
    # The allocator's library stands in a file of the test's own, so the preload path runs on every
    # machine (a fresh CI machine has no tcmalloc), and a missing library makes the setup None.
    library = tmp_path / "libtcmalloc_minimal.so.4"
    library.write_bytes(b"")
    monkeypatch.setitem(ALLOCATORS, "tcmalloc", (str(library),))
    assert setup_environment("tcmalloc+passive") == {**setup_environment("tcmalloc"), "OMP_WAIT_POLICY": "PASSIVE"}
    assert setup_environment("tcmalloc")["LD_PRELOAD"] == str(library)
    monkeypatch.setitem(ALLOCATORS, "tcmalloc", (str(tmp_path / "missing.so"),))
    assert setup_environment("tcmalloc+passive") is None
    assert "OMP_WAIT_POLICY" not in setup_environment("default")
    assert "OMP_WAIT_POLICY" not in os.environ


def test_rounds_turn_the_order_of_policies_and_conditions_around():
    first, second = round_order(["a", "b"], 0), round_order(["a", "b"], 1)
    assert first == [("a", "alone"), ("a", "busy neighbor"), ("b", "alone"), ("b", "busy neighbor")]
    assert second == [("b", "busy neighbor"), ("b", "alone"), ("a", "busy neighbor"), ("a", "alone")]


def test_a_fixed_policy_turns_the_thread_governor_off_and_keeps_its_openmp_settings(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    assert policy_overrides("spin1k+fixed") == {"cpu_adaptive_threads": "false"}
    assert policy_overrides("default") == {}
    assert policy_environment("spin1k+fixed")["GOMP_SPINCOUNT"] == "1000"
    assert "GOMP_SPINCOUNT" not in policy_environment("default+fixed")  # the caller's own setting is not inherited
    check_policies(["default", "passive+fixed"])
    with pytest.raises(SystemExit, match="unknown spin3"):
        check_policies(["default", "spin3+fixed"])
