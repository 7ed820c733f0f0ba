"""IterativeDriver (the `llm_iterative` model's per-execute() logic) with fake pb_utils and engine core.

Covers the sequence-batcher contract without a server: null requests skipped, bad input answered
once and not rescheduled, outputs of sequences absent from a batch buffered and sent merged when
they return, exactly one FINAL, rescheduling only of unfinished sequences, cancellation.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from backend.engine_core.step_on_demand import StepOnDemandClient
from backend.protocol.outputs import EngineStats, FinishReason, RequestOutput
from backend.triton.iterative_model import IterativeDriver

FINAL, RESCHEDULE = 1, 2


class FakeError:
    INVALID_ARG, UNAVAILABLE = "INVALID_ARG", "UNAVAILABLE"

    def __init__(self, message, code=None):
        self.message, self.code = message, code


def make_pb():
    return SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
        TRITONSERVER_REQUEST_RELEASE_RESCHEDULE=RESCHEDULE,
        TritonError=FakeError,
        Tensor=lambda name, array: (name, array),
        InferenceResponse=lambda output_tensors, error=None: SimpleNamespace(tensors=dict(output_tensors), error=error),
        get_input_tensor_by_name=lambda request, name: (
            SimpleNamespace(as_numpy=lambda: request.inputs[name]) if name in request.inputs else None),
    )


class FakeSender:
    def __init__(self):
        self.sent = []  # (response or None, flags)
        self.cancelled = False

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


class FakeRequest:
    def __init__(self, correlation_id, prompt="hi", sender=None, **inputs):
        self._id = correlation_id
        self.inputs = {"text_input": np.array([[prompt.encode()]], dtype=np.object_), "stream": np.array([[True]])}
        self.inputs.update({k: np.array([[v]]) for k, v in inputs.items()})
        self.sender = sender or FakeSender()
        self.release_flags = 0

    def correlation_id(self):
        return self._id

    def get_response_sender(self):
        return self.sender

    def set_release_flags(self, flags):
        self.release_flags = flags


def output(request_id, token, finished=False):
    return RequestOutput(request_id, [token], f"<{token}>", finished,
                         FinishReason.LENGTH if finished else None, 3, 2)


class FakeCore:
    """The engine as the driver sees it: one ``iterate`` per call; ``script`` holds the steps' outputs."""

    def __init__(self):
        self.added, self.aborted, self.script = [], [], []
        self.drain_grace = None
        self.stats = EngineStats(0, 0, 0.0, 16, 0, 0, 0)

    def begin_drain(self, grace_seconds):
        self.drain_grace = grace_seconds

    def iterate(self, adds, aborts, step):
        self.added.extend(add.request_id for add in adds)
        outputs = []
        for request_id in aborts:
            self.aborted.append(request_id)
            outputs.append(RequestOutput(request_id, [], "", True, FinishReason.ABORT, 3, 0))
        if step and self.script:
            outputs.extend(self.script.pop(0))
        return outputs, self.stats

    def shutdown(self, message):
        pass


class FakeInputs:
    def check_sampling_params(self, params):
        params.max_tokens = 4 if params.max_tokens is None else params.max_tokens  # the model's default_max_tokens
        params.validate()

    def tokenize(self, prompt, add_special_tokens=True):
        return [ord(c) for c in prompt]


class FakeMetrics:
    """What the driver reports: every update_engine_stats call, and the collect-side hooks ignored."""

    def __init__(self):
        self.stats = []
        self.finished = {}  # reason -> requests counted

    @property
    def success(self):
        metrics = self

        class Reasons:
            def __getitem__(self, reason):
                return SimpleNamespace(increment=lambda n: metrics.finished.update({reason: metrics.finished.get(reason, 0) + n}))
        return Reasons()

    def update_engine_stats(self, stats):
        self.stats.append(stats)

    def flush_counters(self):
        pass

    def __getattr__(self, name):  # counters and histograms the response state touches
        return SimpleNamespace(increment=lambda *a: None, observe=lambda *a: None, set=lambda *a: None)


def make_driver(metrics=None):
    core = FakeCore()
    return IterativeDriver(make_pb(), StepOnDemandClient(core, max_queue_len=8), FakeInputs(), "m", metrics=metrics), core


def texts(sender):
    return [(r.tensors["text_output"][0][0].decode() if r is not None and r.error is None else None, f)
            for r, f in sender.sent]


def test_null_requests_are_skipped():
    driver, engine = make_driver()
    null = FakeRequest(0)
    driver.execute([null])
    assert engine.added == [] and null.sender.sent == [] and null.release_flags == 0


def test_bad_input_gets_one_error_final_and_is_not_rescheduled():
    driver, engine = make_driver()
    bad = FakeRequest(5, max_tokens=np.int32(0))
    driver.execute([bad])
    assert engine.added == []
    assert len(bad.sender.sent) == 1
    response, flags = bad.sender.sent[0]
    assert flags == FINAL and "max_tokens" in response.error.message and response.error.code == "INVALID_ARG"
    assert bad.release_flags == 0 and driver.sequences == {}


def test_absent_sequences_are_buffered_and_sent_merged_once_with_one_final():
    driver, engine = make_driver()
    a, b = FakeRequest(1), FakeRequest(2)
    engine.script = [[output("m-1", 10), output("m-2", 20)], [output("m-1", 11), output("m-2", 21, finished=True)],
                     [output("m-1", 12, finished=True)]]
    driver.execute([a, b])
    assert texts(a.sender) == [("<10>", 0)] and texts(b.sender) == [("<20>", 0)]
    assert a.release_flags == b.release_flags == RESCHEDULE
    a.release_flags = b.release_flags = 0
    driver.execute([a])  # b is held back by Triton: its final output waits in the buffer
    assert texts(a.sender)[-1] == ("<11>", 0) and len(b.sender.sent) == 1
    driver.execute([b])  # a's final output is buffered now; b gets its text and FINAL
    assert texts(b.sender) == [("<20>", 0), ("<21>", FINAL)]
    final = b.sender.sent[-1][0].tensors
    assert final["finish_reason"][0][0] == b"length" and final["num_output_tokens"][0][0] == 2
    assert b.release_flags == 0
    a.release_flags = 0
    driver.execute([a])
    assert texts(a.sender) == [("<10>", 0), ("<11>", 0), ("<12>", FINAL)] and a.release_flags == 0
    assert driver.sequences == {}


def test_non_streaming_sends_one_response_at_the_end():
    driver, engine = make_driver()
    a = FakeRequest(1, stream=False)
    engine.script = [[output("m-1", 1)], [output("m-1", 2, finished=True)]]
    driver.execute([a])
    assert a.sender.sent == [] and a.release_flags == RESCHEDULE
    driver.execute([a])
    assert texts(a.sender) == [("<1><2>", FINAL)]


def test_cancelled_sequences_are_aborted_and_closed_once():
    driver, engine = make_driver()
    a, b = FakeRequest(1), FakeRequest(2)
    driver.execute([a, b])
    a.sender.cancelled = True
    a.release_flags = 0
    driver.execute([a, b])
    assert engine.aborted == ["m-1"] and a.sender.sent == [(None, FINAL)] and a.release_flags == 0
    b.sender.cancelled = True  # Triton drops a cancelled sequence: the watcher finds it
    assert driver.reap_cancelled() == 1
    assert engine.aborted == ["m-1", "m-2"] and driver.sequences == {}


def test_a_lost_engine_core_ends_every_sequence_once_and_the_next_one_is_served():
    from backend.engine_core.step_on_demand import CoreLost

    driver, core = make_driver()
    a, b = FakeRequest(1), FakeRequest(2)
    driver.execute([a, b])
    failures = [CoreLost("internal error: the engine core process died"), RuntimeError("would not start")]

    def failing(adds, aborts, step):
        raise failures.pop(0)

    core.iterate, working = failing, core.iterate
    a.release_flags = b.release_flags = 0
    sent_to_b = len(b.sender.sent)
    driver.execute([a])  # b is absent from this batch: rescheduled, it keeps its error until it is back
    assert a.release_flags == 0 and len(b.sender.sent) == sent_to_b and list(driver.sequences) == [2]
    c = FakeRequest(3)
    driver.execute([b, c])  # the replacement core would not start: c ends with that error, b with its own
    assert c.sender.sent[-1][1] == FINAL and "would not start" in c.sender.sent[-1][0].error.message
    for request in (a, b):
        response, flags = request.sender.sent[-1]
        assert flags == FINAL and "engine core process died" in response.error.message
        assert sum(f == FINAL for _, f in request.sender.sent) == 1
    assert b.release_flags == c.release_flags == 0 and driver.sequences == {}
    assert core.added == ["m-1", "m-2"]  # b came back to be answered, not to be served again
    core.iterate = working
    core.script = [[output("m-4", 7, finished=True)]]
    d = FakeRequest(4)
    driver.execute([d])
    assert texts(d.sender) == [("<7>", FINAL)]


def test_a_core_lost_between_iterations_answers_each_sequence_when_triton_hands_it_back():
    from backend.engine_core.step_on_demand import CoreLost

    driver, core = make_driver()
    a, b, d = FakeRequest(1), FakeRequest(2), FakeRequest(4)
    core.script = [[], [output("m-1", 10), output("m-2", 20, finished=True), output("m-4", 40)]]
    driver.execute([a, b, d])
    driver.execute([a, d])  # b's final output waits in the buffer: it is absent
    sent = {r: len(r.sender.sent) for r in (b, d)}

    def lost(adds, aborts, step):
        raise CoreLost("internal error: the engine core process died")

    core.iterate, working = lost, core.iterate
    a.sender.cancelled = True  # a cancel found by the watcher makes it talk to the (dead) core
    assert driver.reap_cancelled() == 1
    assert {r: len(r.sender.sent) for r in (b, d)} == sent  # nothing is sent between iterations
    core.iterate = working
    b.release_flags = d.release_flags = 0
    driver.execute([b, d])
    assert texts(b.sender)[-1] == ("<20>", FINAL)  # it had ended before the core was lost
    response, flags = d.sender.sent[-1]
    assert flags == FINAL and "engine core process died" in response.error.message
    assert b.release_flags == d.release_flags == 0 and driver.sequences == {}
    assert core.added == ["m-1", "m-2", "m-4"]


def test_a_lost_core_zeroes_the_gauges_it_left():
    from backend.engine_core.step_on_demand import CoreLost

    metrics = FakeMetrics()
    driver, core = make_driver(metrics)
    core.stats = EngineStats(2, 1, 0.5, 16, 10, 4, 0)
    driver.execute([FakeRequest(1), FakeRequest(2)])
    assert metrics.stats[-1].num_running == 2

    def lost(adds, aborts, step):
        raise CoreLost("internal error: the engine core process died")

    core.iterate = lost
    driver.execute([FakeRequest(1)])
    last = metrics.stats[-1]
    assert (last.num_running, last.num_waiting, last.kv_cache_usage) == (0, 0, 0.0)
    assert metrics.finished == {"error": 2}  # each lost sequence counted once, the absent one too


def test_draining_refuses_new_sequences_and_hands_the_grace_to_the_core():
    driver, core = make_driver()
    running = FakeRequest(1)
    driver.execute([running])
    driver.begin_drain(3.0)
    driver.begin_drain(9.0)  # once: the first deadline holds
    assert core.drain_grace == 3.0
    late = FakeRequest(2)
    running.release_flags = 0
    driver.execute([running, late])
    response, flags = late.sender.sent[-1]
    assert flags == FINAL and "shutting down" in response.error.message and response.error.code == "UNAVAILABLE"
    assert late.release_flags == 0 and core.added == ["m-1"]
    assert running.release_flags == RESCHEDULE  # still running until the core's deadline ends it
