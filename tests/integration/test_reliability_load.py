"""What the server survives under load (issue 20): many streams, a cancel storm, a pool far too
small, a client killed mid-stream, fuzzed tensors, and memory over thousands of requests.

Each scenario is bounded in time and counts what it sent and what came back. The demo model keeps
them quick; the thresholds are stated where they are set.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.server.process_group import live_processes_in_group
from client.stream import StreamingClient
from tests.integration.processes import describe_processes, processes_whose_command_has
from tests.integration.test_llm_model import metric, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

WORDS = ("the", "server", "streams", "tokens", "cache", "block", "prefix", "über", "東京", "data")


def prompt_set(seed: int, count: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))), rng.randint(1, 12)) for _ in range(count)]


def wait_for_gauges_at_baseline(server, timeout: float) -> float:
    """Seconds until KV usage, running and waiting are all back to 0; fails after ``timeout``."""
    start = time.monotonic()
    while True:
        values = read_metrics(server)
        if (metric(values, "llm_kv_cache_usage_ratio") == 0 and metric(values, "llm_num_requests_running") == 0
                and metric(values, "llm_num_requests_waiting") == 0):
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"gauges not back to baseline after {timeout} s: {values}"
        time.sleep(0.1)


def group_rss_mb(pgid: int) -> float:
    total = 0
    for pid in live_processes_in_group(pgid):
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def test_500_requests_over_25_streams_each_end_once_with_text_or_a_busy_error(make_server):
    server = make_server({"max_num_seqs": "8", "max_queue_len": "15"})
    prompts = prompt_set(seed=3, count=20)
    per_stream, num_streams = 20, 25
    outcomes: list[tuple[int, object]] = []
    lock = threading.Lock()

    def stream(worker: int) -> None:
        with StreamingClient(server.grpc_url) as client:
            for turn in range(per_stream):
                index = (worker * 7 + turn) % len(prompts)
                text, max_tokens = prompts[index]
                result = client.generate(text, timeout=120, max_tokens=max_tokens, ignore_eos=True)
                with lock:
                    outcomes.append((index, result))

    threads = [threading.Thread(target=stream, args=(w,), daemon=True) for w in range(num_streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert len(outcomes) == per_stream * num_streams == 500
    assert all(result.num_final == 1 for _, result in outcomes)  # exactly one final each
    busy = [r for _, r in outcomes if r.error is not None]
    assert all("busy" in r.error and "max_queue_len" in r.error for r in busy), busy[:3]
    done = [(i, r) for i, r in outcomes if r.error is None]
    texts: dict[int, set] = {}
    for index, result in done:
        assert len(result.token_ids) == prompts[index][1] and result.finish_reason == "length"
        texts.setdefault(index, set()).add(tuple(result.token_ids))
    assert all(len(variants) == 1 for variants in texts.values())  # identical prompts, identical greedy tokens
    print(f"\n500 requests: {len(done)} answered, {len(busy)} busy errors, {len(texts)} distinct prompts")
    wait_for_gauges_at_baseline(server, 10)


def test_a_cancel_storm_leaves_nothing_behind_and_the_next_answer_is_unchanged(make_server):
    server = make_server()
    with StreamingClient(server.grpc_url) as client:
        before = client.generate("after the storm", max_tokens=12, ignore_eos=True)
    rng = random.Random(11)
    clients = [StreamingClient(server.grpc_url) for _ in range(64)]
    for client in clients:
        client.send(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 80))), max_tokens=1500,
                    ignore_eos=True, stream=True)
    started = time.monotonic()
    order = list(range(64))
    rng.shuffle(order)
    for index in order:  # cancelled at random moments over about 3 s
        time.sleep(rng.uniform(0.0, 0.09))
        clients[index].close(cancel_requests=True)
    recovered = wait_for_gauges_at_baseline(server, 15)
    print(f"\ncancel storm: 64 streams cancelled over {time.monotonic() - started - recovered:.1f} s; "
          f"gauges at baseline {recovered:.2f} s after the last cancel")
    with StreamingClient(server.grpc_url) as client:
        after = client.generate("after the storm", max_tokens=12, ignore_eos=True)
    assert after.error is None and after.token_ids == before.token_ids
    success = read_metrics(server)
    assert metric(success, "llm_request_success_total", finish_reason="abort") >= 64 - 8  # a few may have finished


def test_a_pool_far_smaller_than_the_load_preempts_and_gives_the_same_text(make_server):
    # 40 blocks of 16 tokens for 16 concurrent requests of up to ~200 tokens each.
    server = make_server({"num_kv_blocks": "41", "max_num_seqs": "16", "enable_prefix_caching": "false"})
    rng = random.Random(5)
    jobs = [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 90))), rng.randint(40, 90)) for _ in range(16)]
    results: list = [None] * len(jobs)

    def run(i):
        with StreamingClient(server.grpc_url) as client:
            results[i] = client.generate(jobs[i][0], timeout=300, max_tokens=jobs[i][1], ignore_eos=True, stream=True)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(400)
    preemptions = metric(read_metrics(server), "llm_num_preemptions_total")
    assert all(r is not None and r.error is None and len(r.token_ids) == n for r, (_, n) in zip(results, jobs, strict=True))
    assert preemptions > 0
    with StreamingClient(server.grpc_url) as client:  # each alone: no preemption
        alone = [client.generate(text, timeout=120, max_tokens=n, ignore_eos=True).token_ids for text, n in jobs]
    assert [r.token_ids for r in results] == alone
    print(f"\nKV exhaustion: 16 requests in 40 blocks, {preemptions:.0f} preemptions, text equal to running alone")


def test_a_client_killed_mid_stream_has_its_requests_aborted_and_its_kv_freed(make_server):
    server = make_server()
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).resolve().parents[2])!r})
        from client.stream import StreamingClient
        client = StreamingClient({server.grpc_url!r})
        for i in range(4):
            client.send(f"killed client {{i}}", max_tokens=1800, ignore_eos=True, stream=True)
        print("sent", flush=True)
        time.sleep(600)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "sent"
        deadline = time.monotonic() + 60
        while metric(read_metrics(server), "llm_num_requests_running") < 4:
            assert time.monotonic() < deadline, "the client's requests never started"
            time.sleep(0.1)
        process.kill()
        killed = time.monotonic()
    finally:
        process.kill()
        process.wait()
    recovered = wait_for_gauges_at_baseline(server, 10)
    print(f"\nclient SIGKILLed: its 4 requests aborted and KV freed {time.monotonic() - killed:.2f} s later")
    assert recovered < 10


# A fuzzed request: a random set of the model's inputs (and strangers), random dtypes and shapes,
# random values: NaN, inf, extreme integers, binary and huge strings, malformed JSON.
INPUT_NAMES = ["text_input", "messages", "max_tokens", "min_length", "stream", "temperature", "top_p", "top_k",
               "random_seed", "stop_words", "ignore_eos", "exclude_input_in_output", "sampling_parameters",
               "seed", "return_logprobs", "no_such_input"]
DTYPES = [np.int32, np.int64, np.uint64, np.float32, np.float64, np.bool_, np.object_]
# The dtypes config.pbtxt declares: most fuzzed inputs use them, so the request reaches execute().
CONFIG_DTYPES = {"text_input": np.object_, "messages": np.object_, "stop_words": np.object_,
                 "sampling_parameters": np.object_, "max_tokens": np.int32, "min_length": np.int32,
                 "top_k": np.int32, "temperature": np.float32, "top_p": np.float32, "random_seed": np.uint64,
                 "seed": np.uint64, "stream": np.bool_, "ignore_eos": np.bool_, "exclude_input_in_output": np.bool_,
                 "return_logprobs": np.bool_}
STRINGS = st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode),
                    st.sampled_from([b"{", b"[" * 5000, b'{"max_tokens": 1e999}', b'{"stop_token_ids": [-1]}',
                                     b'{"temperature": "NaN"}', b"\xff\xfe", b"x" * 300_000, b'[{"role":"user"}]']))
NUMBERS = st.one_of(st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63]))


@st.composite
def fuzzed_inputs(draw):
    names = draw(st.lists(st.sampled_from(INPUT_NAMES), min_size=1, max_size=6, unique=True))
    inputs = []
    for name in names:
        declared = CONFIG_DTYPES.get(name)
        dtype = declared if declared is not None and draw(st.integers(0, 9)) < 7 else draw(st.sampled_from(DTYPES))
        shape = draw(st.sampled_from([(1, 1), (1, 1), (1, 1), (1, 2), (2, 1), (1, 0)]))
        count = int(np.prod(shape))
        if dtype is np.object_:
            values = draw(st.lists(STRINGS, min_size=count, max_size=count))
            array = np.array(values, dtype=np.object_).reshape(shape)
        elif dtype is np.bool_:
            array = np.array(draw(st.lists(st.booleans(), min_size=count, max_size=count)), dtype=dtype).reshape(shape)
        else:
            raw = draw(st.lists(NUMBERS, min_size=count, max_size=count))
            with np.errstate(all="ignore"):
                array = np.array([np.array(v).astype(dtype) if np.isfinite(v) or np.issubdtype(dtype, np.floating)
                                  else dtype(0) for v in raw], dtype=dtype).reshape(shape)
        inputs.append((name, array))
    return inputs


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, demo_model_dir):
    from backend.server.launcher import start_server
    from tests.integration.conftest import write_model_repository

    repo = write_model_repository(tmp_path_factory.mktemp("fuzz"), demo_model_dir, {"default_max_tokens": "4"})
    server = start_server(repo, ready_timeout=300)
    yield server
    server.stop()


def send_raw(url: str, model: str, inputs: list[tuple[str, np.ndarray]], timeout: float = 60.0):
    """One request on its own stream; returns its (result, error) events up to its final one or its
    error. Fails when neither comes within ``timeout``.

    The stream is closed without cancelling: on Triton 2.51 a stream that carried a request Triton
    itself refused (wrong dtype or shape) and is closed with cancel keeps the model's stub busy
    until the server's exit timeout (test_rejected_request_then_cancel_delays_shutdown below)."""
    from tritonclient.utils import np_to_triton_dtype

    events: list = []
    done = threading.Event()

    def callback(result, error):
        events.append((result, error))
        if error is not None or (result is not None and result.get_response().parameters.get(
                "triton_final_response") and result.get_response().parameters["triton_final_response"].bool_param):
            done.set()

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    try:
        tensors = []
        for name, array in inputs:
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        client.async_stream_infer(model, tensors, enable_empty_final_response=True)
        assert done.wait(timeout), f"no final response or error within {timeout} s for {[(n, a.dtype, a.shape) for n, a in inputs]}"
        seen = list(events)
    finally:
        client.stop_stream()
        client.close()
    return seen


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(inputs=fuzzed_inputs())
def test_fuzzed_tensors_each_get_an_error_or_a_final_response_and_the_server_stays_ready(fuzz_server, inputs):
    events = send_raw(fuzz_server.grpc_url, "llm", inputs)
    assert events  # an error, or responses ending with the final one
    assert fuzz_server.process.poll() is None and fuzz_server.is_ready()


def test_unknown_models_and_one_megabyte_prompts_are_refused_cleanly(fuzz_server):
    text = np.array([[b"hello"]], dtype=np.object_)
    (result, error), = send_raw(fuzz_server.grpc_url, "no_such_model", [("text_input", text)])
    assert result is None and "no_such_model" in error.message()
    huge = np.array([["é".encode() * 500_000]], dtype=np.object_)  # 1,000,000 bytes
    events = send_raw(fuzz_server.grpc_url, "llm", [("text_input", huge)])
    assert any(error is not None and "max_prompt_bytes" in error.message() for _, error in events)
    with StreamingClient(fuzz_server.grpc_url) as client:
        assert client.generate("still serving", max_tokens=3, ignore_eos=True).error is None


def test_memory_stays_flat_over_2000_requests(make_server):
    server = make_server({"default_max_tokens": "4"})
    pgid = server.process.pid

    def burst(count: int) -> None:
        def worker(n):
            with StreamingClient(server.grpc_url) as client:
                for i in range(n):
                    assert client.generate(f"memory check {i % 37}", max_tokens=4, ignore_eos=True).error is None

        threads = [threading.Thread(target=worker, args=(count // 20,), daemon=True) for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)

    burst(400)  # warm-up: allocator pools, tokenizer caches, metric series
    # The compile worker's fork server imports xgrammar and torch at low priority beside the load
    # (about 200 MB): not what requests leave behind, so it is done before the first measure.
    deadline = time.monotonic() + 120
    while (not re.search(r"compile worker \d+ started", server.log_path.read_text(errors="replace"))
           and time.monotonic() < deadline):
        time.sleep(0.5)
    warm = group_rss_mb(pgid)
    burst(2000)
    middle = group_rss_mb(pgid)
    burst(2000)
    after = group_rss_mb(pgid)
    print(f"\nRSS of tritonserver and its stubs: {warm:.0f} MB after warm-up, {middle:.0f} MB after 2,000 more "
          f"requests (+{middle - warm:.1f} MB), {after:.0f} MB after 2,000 more (+{after - middle:.1f} MB)")
    # The second 2,000 requests: allocator pools have grown by then, so what they add is what leaks.
    assert after - middle < MEMORY_GROWTH_BOUND_MB
    wait_for_gauges_at_baseline(server, 10)


# Measured here (demo model, 4-token requests, 20 streams): +13.8 and +39.6 MB over 2,000 requests
# after a 400-request warm-up; over 5,000 the stub went 873 -> 938 MB (about 13 KB a request, not
# levelling off yet; glibc keeps freed memory up to the 256 MB trim threshold that
# model_runner.tune_cpu_allocator sets, so this is not proven a leak). Later, on a faster machine,
# the first 2,000 added 70-111 MB (and once 333 MB in CI) while the allocator still grew, so the
# bound is checked on the second 2,000.
# Part of that was the compile worker's fork server still importing xgrammar and torch (about 200 MB)
# inside the measured windows, more so since it imports at low priority; waited for, the two windows
# added 17-48 MB here (Intel with AMX, 2026-12-05).
MEMORY_GROWTH_BOUND_MB = 128


def test_rejected_request_then_cancel_keeps_a_stub_alive_across_unload(make_server):
    """Documents Triton 2.51's behaviour (measured with a one-file Python model too, so not ours): a
    stream that carried a request Triton itself refused (wrong dtype) and was then closed with
    cancel keeps the unloaded model's stub alive; the reload starts a second one. Shutdown still
    leaves no process: the launcher kills the group after tritonserver's exit timeout."""
    import tritonclient.http as httpclient

    server = make_server(extra_args=["--model-control-mode=explicit", "--load-model=llm"])
    pgid = server.process.pid
    http = httpclient.InferenceServerClient(server.http_url)

    def stubs() -> int:
        return len(processes_whose_command_has(b"triton_python_backend_stub", among=live_processes_in_group(pgid)))

    assert stubs() == 1
    client = grpcclient.InferenceServerClient(server.grpc_url)
    errors = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    wrong = grpcclient.InferInput("max_tokens", [1, 1], "FP32")  # config.pbtxt says INT32
    wrong.set_data_from_numpy(np.array([[4.0]], dtype=np.float32))
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"hello"]], dtype=np.object_))
    client.async_stream_infer("llm", [text, wrong], enable_empty_final_response=True)
    deadline = time.monotonic() + 30
    while not errors:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "max_tokens" in str(errors[0])  # Triton's own refusal, before the model
    client.stop_stream(cancel_requests=True)
    client.close()
    http.unload_model("llm")
    deadline = time.monotonic() + 60
    while http.is_model_ready("llm"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    http.load_model("llm")
    assert http.is_model_ready("llm")
    time.sleep(1.0)
    leaked = stubs()
    with StreamingClient(server.grpc_url) as stream:
        assert stream.generate("still serving", max_tokens=3, ignore_eos=True).error is None
    print(f"\nstubs alive after unload + reload: {leaked} (1 expected without the Triton behaviour)")
    assert leaked == 2
    http.close()  # our own open HTTP connection would hold the stop for the exit timeout too
    stopped = time.monotonic()
    server.stop()
    left = live_processes_in_group(pgid)
    assert not left, describe_processes(left)
    print(f"stop took {time.monotonic() - stopped:.1f} s")
