"""perf.engine_settings: the alternation order and the table of medians (the runs themselves are benchmarks)."""

from perf.engine_settings import COLUMNS, medians, round_order, table


def run(tok_s: float, itl_p99: float) -> dict:
    row = {key: 1.0 for _, key, _ in COLUMNS}
    row.update(output_tok_s=tok_s, itl_p99_ms=itl_p99)
    return row


def test_rounds_alternate_their_order():
    assert round_order(["512", "2048"], 0) == ["512", "2048"]
    assert round_order(["512", "2048"], 1) == ["2048", "512"]
    assert round_order(["a", "b", "c"], 2) == ["a", "b", "c"]


def test_medians_and_table():
    runs = {"512": [run(600, 140), run(650, 150), run(640, 130)], "2048": [run(730, 320), run(700, 330)], "4096": []}
    got = medians(runs)
    assert got["512"]["output_tok_s"] == 640 and got["512"]["itl_p99_ms"] == 140
    assert got["2048"]["output_tok_s"] == 715 and "4096" not in got
    lines = table("max_num_batched_tokens", runs).splitlines()
    assert lines[0].startswith("| max_num_batched_tokens | tok/s |") and lines[0].endswith("| runs |")
    assert lines[2].startswith("| 512 | 640.0 |") and lines[2].endswith("| 3 |")
    assert lines[3].startswith("| 2048 | 715.0 |") and len(lines) == 4
