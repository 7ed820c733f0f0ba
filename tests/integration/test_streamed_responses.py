"""Response coalescing and ``stream_interval`` through a real tritonserver.

Two servers on the demo model with ngram speculative decoding, one with ``response_coalescing``
on (the default) and one with it off, get the same mixed load at once per server (plain greedy
streams, stop strings, logprobs, n = 2 seeded samples, beams, ``stream_interval`` 4): every request
gets the same text, ids and logprobs from both, exactly one FINAL, and the generation-token
counter equals the tokens streamed; without coalescing a streamed greedy request gets one response
per step, with it the load's response count falls below its token count.
"""

from __future__ import annotations

import math
import random
import time

import pytest

from tests.integration.test_llm_model import metric, read_metrics, run_concurrently

pytestmark = pytest.mark.integration

SPECULATION = {"speculative_method": "ngram", "num_speculative_tokens": "3", "speculative_controller": "off"}
NUM_PLAIN = 64
WORDS = ("the", "server", "streams", "tokens", "cache", "block", "prefix", "data", "and", "again", "the cache")


def mixed_jobs(seed: int = 11) -> list[tuple[str, dict]]:
    rng = random.Random(seed)

    def prompt() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))

    # Many short greedy streams: the engine's steps come faster than their responses can be sent.
    jobs = [(f"{rng.choice(WORDS)} {i}", {"max_tokens": rng.randint(24, 48), "ignore_eos": True, "stream": True})
            for i in range(NUM_PLAIN)]
    jobs += [(prompt(), {"max_tokens": 32, "stream": True, "stop_words": ["cache", "block"]}) for _ in range(2)]
    jobs += [(prompt(), {"max_tokens": 16, "ignore_eos": True, "stream": True,
                         "sampling_parameters": {"logprobs": 2}}) for _ in range(2)]
    jobs += [(prompt(), {"max_tokens": 12, "ignore_eos": True, "stream": True,
                         "sampling_parameters": {"n": 2, "temperature": 0.8, "seed": 5 + i}}) for i in range(2)]
    jobs += [(prompt(), {"max_tokens": 8, "stream": True, "sampling_parameters": {"beam_width": 2, "n": 2}})
             for _ in range(2)]
    jobs += [(prompt(), {"max_tokens": 30, "ignore_eos": True, "stream": True,
                         "sampling_parameters": {"stream_interval": 4}}) for _ in range(2)]
    return jobs


def serve_and_measure(server, jobs):
    before = read_metrics(server)
    results = run_concurrently(server.grpc_url, jobs)
    time.sleep(0.5)
    after = read_metrics(server)
    return results, metric(after, "llm_generation_tokens_total") - metric(before, "llm_generation_tokens_total")


def streamed_tokens(result) -> int:
    if result.sample_token_ids:
        return sum(len(ids) for ids in result.sample_token_ids.values())
    return len(result.token_ids)


def test_coalescing_on_and_off_stream_the_same_tokens_and_coalescing_sends_fewer_responses(make_server):
    jobs = mixed_jobs()
    on_server = make_server(SPECULATION)
    on_results, on_counted = serve_and_measure(on_server, jobs)
    off_results, off_counted = serve_and_measure(make_server({**SPECULATION, "response_coalescing": "false"}), jobs)
    for (prompt, options), on, off in zip(jobs, on_results, off_results, strict=True):
        for result in (on, off):
            assert result.error is None, (prompt, options, result.error)
            assert result.num_final == 1, (prompt, options)
        if not on.sample_texts:  # n > 1: samples' deltas interleave in arrival order, compared per sample
            assert on.text == off.text and on.token_ids == off.token_ids, (prompt, options)
        assert on.sample_texts == off.sample_texts and on.sample_token_ids == off.sample_token_ids, options
        assert on.finish_reason == off.finish_reason
        assert on.output_log_probs == pytest.approx(off.output_log_probs, abs=1e-4)
        interval = options.get("sampling_parameters", {}).get("stream_interval")
        if interval is not None:
            for result in (on, off):
                assert result.num_responses <= math.ceil(len(result.token_ids) / interval) + 1
    assert on_counted == sum(streamed_tokens(r) for r in on_results)
    assert off_counted == sum(streamed_tokens(r) for r in off_results)
    plain = range(NUM_PLAIN)  # greedy streams without a stop string: a response per step when not coalesced
    assert all(off_results[i].num_responses <= len(off_results[i].token_ids) for i in plain)
    off_responses = sum(off_results[i].num_responses for i in plain)
    on_responses = sum(on_results[i].num_responses for i in plain)
    print(f"responses for {sum(len(on_results[i].token_ids) for i in plain)} tokens: "
          f"{on_responses} coalesced, {off_responses} not")
    # Whether steps wait for the responder is timing (in CI it sometimes never fell behind): never
    # more responses with coalescing; that waiting steps do merge is asserted in
    # tests/unit/test_response_coalescing.py.
    assert on_responses <= off_responses
