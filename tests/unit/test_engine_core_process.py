"""The engine core in its own process (backend/engine_core), without Triton.

Greedy text equals the in-process engine; kill -9 of the core ends every request in flight with
one error and the next request is served by a new core; a hung core (SIGSTOP) is found by its
silence; a stopped client and a killed parent leave no core process; the step-on-demand core of
`llm_iterative` answers each call and recovers the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.engine_core.admission import BusyError
from backend.engine_core.process_client import ProcessClient
from backend.engine_core.step_on_demand import CoreLost, ProcessTransport
from backend.paths import REPO_ROOT
from backend.proc_stat import read_proc_stat
from backend.protocol.messages import AddRequest
from backend.protocol.sampling import SamplingParams
from backend.server.process_group import live_processes_in_group
from tests.conftest import DEMO_REPOSITORY
from tests.integration.processes import describe_processes

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3,", "Hello", "A B C D E"]


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm")))


def process_alive(pid: int) -> bool:
    stat = read_proc_stat(pid)
    return stat is not None and not stat.zombie


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.05)
    return False


def add(engine, request_id: str, prompt: str, **params) -> AddRequest:
    return AddRequest(request_id, engine.tokenize(prompt), SamplingParams(**params), time.monotonic())


def run_to_finals(client, requests: list[AddRequest], timeout: float = 120.0) -> dict:
    """Submits and collects {request id: (text, final output)}; asserts exactly one final each."""
    texts, finals = {r.request_id: "" for r in requests}, {}
    for request in requests:
        client.submit(request)
    client.flush()  # one message for all of them, as execute() sends a batch
    deadline = time.monotonic() + timeout
    while len(finals) < len(requests):
        assert time.monotonic() < deadline, f"finals missing: {set(texts) - set(finals)}"
        item = client.outbox.get(timeout=timeout)
        assert item is not None
        for output in item[0]:
            assert output.request_id not in finals, f"a second final for {output.request_id}"
            texts[output.request_id] += output.text
            if output.finished:
                finals[output.request_id] = output
    return {request_id: (texts[request_id], finals[request_id]) for request_id in texts}


def run_after_restart(client, make_request, timeout: float = 60.0) -> dict:
    """run_to_finals of one request, sent again while the client is refused as busy (a new core
    loading after a crash) until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return run_to_finals(client, [make_request()])
        except BusyError as exc:
            assert "restarting" in str(exc) and time.monotonic() < deadline
            time.sleep(0.2)


@pytest.fixture
def client(engine):
    made = ProcessClient(engine.config, max_queue_len=64, heartbeat_timeout=3.0)
    made.start()
    yield made
    pid = made.core_pid
    made.stop(timeout=10)
    assert wait_gone(pid, 10), "stop() left the engine core running"


def test_greedy_text_through_the_core_process_equals_the_engine_in_process(client, engine):
    params = [dict(max_tokens=8 + 5 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    expected = engine.generate(PROMPTS, [SamplingParams(**p) for p in params])
    results = run_to_finals(client, [add(engine, f"r{i}", prompt, **params[i]) for i, prompt in enumerate(PROMPTS)])
    for i, want in enumerate(expected):
        text, final = results[f"r{i}"]
        assert final.error is None and final.num_output_tokens == params[i]["max_tokens"]
        assert text == want.text


def test_kill_9_of_the_core_ends_each_request_once_with_an_error_and_a_new_core_serves(client, engine):
    restarts = []
    client.on_restart = restarts.append
    old_pid = client.core_pid
    for i in range(3):
        client.submit(add(engine, f"long{i}", PROMPTS[i], max_tokens=1500, ignore_eos=True))
    client.flush()
    streamed = 0
    while streamed < 3:  # every request has produced tokens: they are mid-stream
        item = client.outbox.get(timeout=60)
        streamed += sum(1 for o in item[0] if o.new_token_ids)
    killed_at = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    finals = {}
    while len(finals) < 3:
        item = client.outbox.get(timeout=10)
        for output in item[0]:
            if output.finished:
                assert output.request_id not in finals
                finals[output.request_id] = output
    assert time.monotonic() - killed_at < 10
    assert all("engine core process died" in f.error and "SIGKILL" in f.error for f in finals.values())
    assert len(restarts) == 1 and client.restarts == 1
    result = run_after_restart(client, lambda: add(engine, "after", "Hello", max_tokens=4, ignore_eos=True))
    assert result["after"][1].error is None and result["after"][1].num_output_tokens == 4
    assert client.core_pid != old_pid and not process_alive(old_pid)


def test_a_silent_core_is_found_by_its_heartbeat_killed_and_replaced(client, engine):
    client.submit(add(engine, "stuck", "Hello", max_tokens=1500, ignore_eos=True))
    client.flush()
    time.sleep(0.5)
    stopped_pid = client.core_pid
    os.kill(stopped_pid, signal.SIGSTOP)  # alive but silent, as a hung forward would be
    started = time.monotonic()
    while True:
        item = client.outbox.get(timeout=20)
        final = next((o for o in item[0] if o.finished), None)
        if final is not None:
            break
    assert "stopped answering" in final.error and "engine_heartbeat_timeout_seconds" in final.error
    assert 2.5 < time.monotonic() - started < 10
    assert wait_gone(stopped_pid, 5) and client.restarts == 1


def test_a_killed_parent_leaves_no_orphan_core(demo_model_dir, tmp_path):
    pid_file = tmp_path / "core.pid"
    script = textwrap.dedent(f"""
        import time
        from backend.config import engine_config_from_model_folder
        from backend.engine_core.process_client import ProcessClient
        client = ProcessClient(engine_config_from_model_folder({str(DEMO_REPOSITORY / "llm")!r}), 4)
        client.start()
        open({str(pid_file)!r}, "w").write(str(client.core_pid))
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.1)
        core_pid = int(pid_file.read_text())
        assert process_alive(core_pid)
        parent.kill()
        parent.wait()
        assert wait_gone(core_pid, 5), "the engine core outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_stopped_core_leaves_no_process_even_while_its_compile_fork_server_starts(demo_model_dir):
    """The core's stop comes while the compile worker's fork server is still importing (seconds after
    the core is ready): the fork server and multiprocessing's resource tracker are gone by the time
    ``stop`` returns, as a stopped tritonserver's process group must be."""
    script = textwrap.dedent(f"""
        import json, os, time
        from backend.config import engine_config_from_model_folder
        from backend.engine_core.process_client import ProcessClient
        from backend.server.process_group import live_processes_in_group
        from tests.integration.processes import describe_processes, processes_whose_command_has

        def ours():
            return [pid for pid in live_processes_in_group(os.getpgid(0)) if pid != os.getpid()]

        client = ProcessClient(engine_config_from_model_folder({str(DEMO_REPOSITORY / "llm")!r}), 4)
        client.start()
        deadline = time.monotonic() + 60
        while not (fork_servers := processes_whose_command_has(b"multiprocessing.forkserver", among=ours())):
            assert time.monotonic() < deadline, "no fork server started"
            time.sleep(0.01)
        client.stop()
        left = ours()
        print(json.dumps({{"fork_servers": fork_servers, "left": left, "described": describe_processes(left)}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=180, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["fork_servers"]
    assert report["left"] == [], report["described"]


def test_a_killed_parent_leaves_no_process_even_while_the_cores_compile_fork_server_starts(demo_model_dir, tmp_path):
    """The front end (a stub, a killed tritonserver's) dies while the core's compile fork server is
    still importing: the core, the fork server and multiprocessing's resource tracker are all gone
    within a second of the core's exit, not seconds later when the fork server gets the CPU."""
    pids_file = tmp_path / "pids.json"
    script = textwrap.dedent(f"""
        import json, os, time
        from backend.config import engine_config_from_model_folder
        from backend.engine_core.process_client import ProcessClient
        from backend.server.process_group import live_processes_in_group
        from tests.integration.processes import processes_whose_command_has

        client = ProcessClient(engine_config_from_model_folder({str(DEMO_REPOSITORY / "llm")!r}), 4)
        client.start()
        deadline = time.monotonic() + 60
        while not (fork_servers := processes_whose_command_has(
                b"multiprocessing.forkserver", among=live_processes_in_group(os.getpgid(0)))):
            assert time.monotonic() < deadline, "no fork server started"
            time.sleep(0.01)
        open({str(pids_file)!r}, "w").write(json.dumps({{"core": client.core_pid, "fork_servers": fork_servers}}))
        time.sleep(600)
    """)
    log = tmp_path / "stderr.log"
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, start_new_session=True,
                              stderr=open(log, "wb"))  # noqa: SIM115 (the core writes to it after the parent's death)
    try:
        deadline = time.monotonic() + 120
        while not pids_file.exists() or not pids_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.01)
        pids = json.loads(pids_file.read_text())
        parent.kill()
        parent.wait()
        assert wait_gone(pids["core"], 5), "the engine core outlived its parent"
        time.sleep(1.0)
        left = live_processes_in_group(parent.pid)
        assert left == [], describe_processes(left)
        # The worker's start that the exit cut short is no fault: no ERROR, no traceback.
        assert "did not start" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-3000:]
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in live_processes_in_group(parent.pid):
            os.kill(pid, signal.SIGKILL)


def test_the_step_on_demand_core_answers_each_call_and_recovers_from_kill_9(engine):
    core = ProcessTransport(engine.config, heartbeat_timeout=10.0)
    core.start()
    try:
        request = add(engine, "it", PROMPTS[0], max_tokens=6, ignore_eos=True)
        text, steps, final = "", 0, None
        outputs, _ = core.iterate([request], [], step=True)
        while final is None:
            for output in outputs:
                text += output.text
                final = output if output.finished else final
            if final is None:
                outputs, _ = core.iterate([], [], step=True)
            steps += 1
        assert steps == 6 and final.error is None  # one token per call: the core never ran ahead
        assert text == engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, ignore_eos=True))[0].text
        core.iterate([add(engine, "long", "Hello", max_tokens=1500, ignore_eos=True)], [], step=True)
        old_pid = core.core_pid
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(CoreLost, match="SIGKILL"):
            core.iterate([], [], step=True)
        assert core.restarts == 1
        outputs, stats = core.iterate([add(engine, "next", "Hello", max_tokens=1)], [], step=True)
        assert [o.finished for o in outputs] == [True] and outputs[0].error is None
        assert core.core_pid != old_pid and stats.num_running == 0
    finally:
        pid = core.core_pid
        core.shutdown("test over")
        assert wait_gone(pid, 10)
