"""The `llm` responder's coalescing and ``stream_interval``: fewer responses, the same tokens, one FINAL.

The responder runs on its real thread against an outbox filled by hand, with fake Triton objects
(tests/unit/test_iterative_driver.py's) that keep every response sent.
"""

from __future__ import annotations

import math
import queue
import time
from collections import defaultdict

import pytest

from backend.engine_core.engine_client import EngineOutputs, empty_stats
from backend.protocol.outputs import FinishReason, RequestOutput
from backend.triton.inputs import InputError, parse_request
from backend.triton.responder import ActiveRequest, Responder
from backend.triton.response_state import ResponseState
from tests.unit.test_iterative_driver import FINAL, FakeSender, make_pb


class FakeEngine:
    def __init__(self):
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class Recorder:
    """Stands in for a Prometheus family: counts and observations."""

    def __init__(self):
        self.total = 0.0
        self.values: list[float] = []

    def increment(self, value):
        self.total += value

    def observe(self, value):
        self.values.append(value)


class FakeMetrics:
    def __init__(self):
        self.success = defaultdict(Recorder)
        self.stats_seen = 0

    def __getattr__(self, name):  # ttft, itl, generation_tokens, ...: one Recorder each
        recorder = Recorder()
        setattr(self, name, recorder)
        return recorder

    def flush_counters(self):
        pass

    def update_engine_stats(self, stats):
        self.stats_seen += 1


def token(request_id: str, token_id: int, total: int, finished: bool = False, index: int = 0,
          logprob: float | None = None) -> RequestOutput:
    return RequestOutput(request_id=request_id, new_token_ids=[token_id], text=f"<{token_id}>", finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None, num_prompt_tokens=3,
                         num_output_tokens=total, sequence_index=index, sequence_finished=finished,
                         logprobs=None if logprob is None else [logprob])


def state(request_id: str, stream_interval: int = 1, **options) -> ResponseState:
    return ResponseState(request_id, stream=True, exclude_input_in_output=True, prompt="p", arrival_time=0.0,
                         stream_interval=stream_interval, **options)


def run_responder(items: list[EngineOutputs], states: list[ResponseState], coalesce: bool, metrics=None):
    """Registers ``states``, queues ``items`` before the thread starts (a responder that fell
    behind finds them all waiting), and returns each request's sender once the thread stopped."""
    engine = FakeEngine()
    responder = Responder(make_pb(), engine, metrics, coalesce=coalesce)
    senders = {}
    for s in states:
        senders[s.request_id] = FakeSender()
        responder.register(ActiveRequest(s, senders[s.request_id]))
    for item in items:
        engine.outbox.put(item)
    engine.outbox.put(None)
    responder.start()
    responder.join(timeout=10)
    return senders


def sent_ids(sender: FakeSender) -> list[int]:
    return [int(t) for response, _ in sender.sent if response is not None and response.error is None
            for t in response.tensors["output_ids"].reshape(-1)]


def sent_text(sender: FakeSender) -> str:
    return "".join(response.tensors["text_output"].reshape(-1)[0].decode() for response, _ in sender.sent
                   if response is not None)


def interleaved(request_ids: list[str], num_tokens: int, start: float = 100.0) -> list[EngineOutputs]:
    """One engine step per item, each giving every request its next token; the last one ends them."""
    return [EngineOutputs([token(r, 10 * step + i, step + 1, finished=step == num_tokens - 1)
                           for i, r in enumerate(request_ids)], empty_stats(), start + 0.25 * step)
            for step in range(num_tokens)]


def test_waiting_steps_leave_in_one_response_per_request_with_the_same_tokens():
    ids = ["a", "b", "c"]
    coalesced = run_responder(interleaved(ids, 5), [state(r) for r in ids], coalesce=True)
    per_step = run_responder(interleaved(ids, 5), [state(r) for r in ids], coalesce=False)
    for r in ids:
        assert sent_ids(coalesced[r]) == sent_ids(per_step[r]) and len(sent_ids(per_step[r])) == 5
        assert sent_text(coalesced[r]) == sent_text(per_step[r])
        assert len(per_step[r].sent) == 5  # one per step without coalescing
        assert len(coalesced[r].sent) == 1  # everything was waiting: one response, the final one
        assert [flags for _, flags in coalesced[r].sent].count(FINAL) == 1
        assert [flags for _, flags in per_step[r].sent].count(FINAL) == 1


def test_a_lone_request_still_gets_one_response_per_token():
    engine = FakeEngine()
    responder = Responder(make_pb(), engine, None, coalesce=True)
    sender = FakeSender()
    responder.register(ActiveRequest(state("solo"), sender))
    responder.start()
    for step in range(4):  # the next step comes only after the last one was sent: no backlog
        engine.outbox.put(EngineOutputs([token("solo", step, step + 1, finished=step == 3)], empty_stats(), 0.0))
        deadline = time.monotonic() + 5
        while len(sender.sent) < step + 1 and time.monotonic() < deadline:
            time.sleep(0.001)
    engine.outbox.put(None)
    responder.join(timeout=10)
    assert len(sender.sent) == 4 and sent_ids(sender) == [0, 1, 2, 3]
    assert [flags for _, flags in sender.sent] == [0, 0, 0, FINAL]


def test_metrics_count_every_token_and_time_each_step_not_each_response():
    metrics = FakeMetrics()
    run_responder(interleaved(["a", "b"], 4), [state("a"), state("b")], coalesce=True, metrics=metrics)
    assert metrics.generation_tokens.total == 8
    assert len(metrics.ttft.values) == 2
    assert metrics.itl.values == pytest.approx([0.25] * 6)  # 3 gaps per request, at the steps' times
    assert metrics.stats_seen == 4  # every step's statistics, coalesced or not


@pytest.mark.parametrize("num_tokens,interval", [(10, 3), (7, 7), (5, 1), (1, 4), (9, 2)])
def test_stream_interval_k_sends_at_most_ceil_tokens_over_k_plus_one_responses(num_tokens, interval):
    s, sender, pb = state("r", stream_interval=interval), FakeSender(), make_pb()
    for step in range(num_tokens):  # flushed after every step, as if the responder kept up
        s.collect(token("r", step, step + 1, finished=step == num_tokens - 1), float(step), None)
        s.flush(pb, sender)
    assert sent_ids(sender) == list(range(num_tokens))
    assert len(sender.sent) <= math.ceil(num_tokens / interval) + 1
    assert sender.sent[0][0].tensors["output_ids"].reshape(-1).tolist() == [0]  # the first token at once
    assert [flags for _, flags in sender.sent].count(FINAL) == 1 and sender.sent[-1][1] == FINAL
    if interval == 1:
        assert len(sender.sent) == num_tokens


def test_samples_keep_their_sequence_index_and_their_own_interval():
    n, num_tokens = 3, 6
    s = state("r", stream_interval=2, num_samples=n)
    items = [EngineOutputs([token("r", 100 * i + step, step + 1, index=i,
                                  finished=step == num_tokens - 1 and i == n - 1) for i in range(n)],
                           empty_stats(), float(step)) for step in range(num_tokens)]
    for i in range(n - 1):  # the other samples end with the last step too
        items[-1].outputs[i].sequence_finished = True
    sender = run_responder(items, [s], coalesce=False)["r"]
    by_sample = defaultdict(list)
    for response, _ in sender.sent:
        index = int(response.tensors["sequence_index"].reshape(-1)[0])
        by_sample[index].extend(int(t) for t in response.tensors["output_ids"].reshape(-1))
    assert dict(by_sample) == {i: [100 * i + step for step in range(num_tokens)] for i in range(n)}
    assert [flags for _, flags in sender.sent].count(FINAL) == 1 and sender.sent[-1][1] == FINAL
    assert len(sender.sent) <= n * (math.ceil(num_tokens / 2) + 1)


def test_logprobs_of_a_coalesced_response_hold_one_value_per_token():
    s = state("r", wants_logprobs=True)
    items = [EngineOutputs([token("r", step, step + 1, finished=step == 3, logprob=-0.5 * step)], empty_stats(), 0.0)
             for step in range(4)]
    sender = run_responder(items, [s], coalesce=True)["r"]
    (response, flags), = sender.sent
    assert flags == FINAL
    assert response.tensors["output_log_probs"].reshape(-1).tolist() == [0.0, -0.5, -1.0, -1.5]
    assert float(response.tensors["cumulative_logprob"].reshape(-1)[0]) == pytest.approx(-3.0)


def test_a_cancelled_request_gets_one_bare_final_however_its_steps_come():
    s = state("r")
    s.cancelled = True
    sender = run_responder(interleaved(["r"], 3), [s], coalesce=True)["r"]
    assert sender.sent == [(None, FINAL)]


def test_a_stop_arriving_behind_waiting_steps_sends_them_first():
    engine = FakeEngine()
    responder = Responder(make_pb(), engine, None, coalesce=True)
    sender = FakeSender()
    responder.register(ActiveRequest(state("r"), sender))
    for item in interleaved(["r"], 2)[:1]:  # one step, the request unfinished, then the stop
        engine.outbox.put(item)
    engine.outbox.put(None)
    responder.start()
    responder.join(timeout=10)
    assert sent_ids(sender) == [0]
    assert sender.sent[-1][1] == FINAL and sender.sent[-1][0].error is not None  # unloading: an error FINAL


def get(values: dict):
    import numpy as np  # noqa: PLC0415

    return lambda name: None if name not in values else np.array([[values[name]]], dtype=np.object_)


def test_sampling_parameters_stream_interval_is_read_and_checked():
    def parsed(sampling_parameters: str):
        return parse_request(get({"text_input": b"hi", "sampling_parameters": sampling_parameters.encode()}),
                             lambda params: None)

    assert parsed('{"stream_interval": 4}').stream_interval == 4
    assert parsed('{"stream_interval": "2"}').stream_interval == 2
    assert parsed('{"stream_interval": null}').stream_interval is None
    assert parsed("{}").stream_interval is None
    for bad in ('{"stream_interval": 0}', '{"stream_interval": -3}', '{"stream_interval": 1.5}',
                '{"stream_interval": true}'):
        with pytest.raises(InputError, match=r"^sampling_parameters\.stream_interval: "):
            parsed(bad)


def test_config_stream_interval_must_count_something():
    from backend.config import ConfigError  # noqa: PLC0415
    from backend.triton.helpers import positive_int_parameter  # noqa: PLC0415

    assert positive_int_parameter({}, "stream_interval", 1) == 1
    assert positive_int_parameter({"stream_interval": " 8 "}, "stream_interval", 1) == 8
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ConfigError, match="parameter 'stream_interval'"):
            positive_int_parameter({"stream_interval": bad}, "stream_interval", 1)


def test_cancellation_polls_ask_a_bounded_number_of_requests_oldest_first():
    """Each is_cancelled() is a round trip to tritonserver: one poll asks at most
    MAX_CANCEL_CHECKS_PER_POLL requests, and every request is asked within ceil(n / max) polls."""
    from backend.triton.responder import MAX_CANCEL_CHECKS_PER_POLL

    class CountingSender(FakeSender):
        def __init__(self):
            super().__init__()
            self.asked = 0

        def is_cancelled(self):
            self.asked += 1
            return self.cancelled

    engine = FakeEngine()
    responder = Responder(make_pb(), engine, None)
    num_requests = 2 * MAX_CANCEL_CHECKS_PER_POLL + 3
    senders = {f"r{i}": CountingSender() for i in range(num_requests)}
    for request_id, sender in senders.items():
        responder.register(ActiveRequest(state(request_id), sender))
    senders["r5"].cancelled = True
    polls = math.ceil(num_requests / MAX_CANCEL_CHECKS_PER_POLL)
    for poll in range(polls):
        before = sum(s.asked for s in senders.values())
        responder._poll_cancellations()
        asked = sum(s.asked for s in senders.values()) - before
        assert asked <= MAX_CANCEL_CHECKS_PER_POLL
        if poll < polls - 1:
            assert max(s.asked for s in senders.values()) == 1  # nobody twice while others wait
        time.sleep(0.002)  # distinct check times
    assert all(s.asked >= 1 for s in senders.values())  # everyone was asked within ceil(n / max) polls
    assert engine.aborted == ["r5"]


def test_only_the_requested_outputs_are_built():
    pb = make_pb()
    asked = ResponseState("r", stream=True, exclude_input_in_output=True, prompt="p", arrival_time=0.0,
                          requested_outputs=frozenset({"text_output"}))
    everything = state("r2")
    for s in (asked, everything):
        s.collect(token(s.request_id, 7, 1, finished=True), 1.0, None)
    sent_asked, sent_all = FakeSender(), FakeSender()
    asked.flush(pb, sent_asked)
    everything.flush(pb, sent_all)
    assert set(sent_asked.sent[0][0].tensors) == {"text_output"}
    assert {"text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens"} <= set(
        sent_all.sent[0][0].tensors)
    assert sent_asked.sent[0][0].tensors["text_output"][0][0] == sent_all.sent[0][0].tensors["text_output"][0][0]


def test_admission_reads_the_requested_output_names():
    from types import SimpleNamespace

    from backend.triton.helpers import requested_outputs

    assert requested_outputs(SimpleNamespace(requested_output_names=lambda: ["text_output"])) == {"text_output"}
    assert requested_outputs(SimpleNamespace(requested_output_names=lambda: [])) is None  # none named: all
    assert requested_outputs(SimpleNamespace()) is None
