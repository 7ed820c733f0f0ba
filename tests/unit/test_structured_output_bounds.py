"""What a constraint may cost (demo model, no server): the budget refuses before compiling, a compile
past the timeout is killed with its worker while a free request steps on at its pace, a client at its
compiles in flight is refused while others are admitted, and a worker killed from outside is replaced.
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch

from backend.config import StructuredOutputConfig, engine_config_from_model_folder
from backend.engine.input_processor import EngineInputError
from backend.engine.llm_engine import LLMEngine
from backend.engine.tokenizer import load_tokenizer
from backend.proc_stat import all_pids, read_proc_stat
from backend.protocol.outputs import FinishReason
from backend.protocol.sampling import SamplingParams
from backend.protocol.structured_output import StructuredOutputError, parse_structured_outputs
from backend.structured_output import compile_worker
from backend.structured_output.budget import check_budget, schema_shape
from backend.structured_output.compile_worker import (
    CompileInterrupted,
    CompileTimeout,
    CompileWorker,
    CompileWorkerError,
)
from backend.structured_output.compiler import GrammarCompiler
from perf.hostile_schemas import slow_schema
from tests.conftest import DEMO_REPOSITORY

PROMPT = [1, 10, 20, 30]
BUDGET = StructuredOutputConfig()


def many_properties(count: int, prefix: str = "p") -> dict:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(count)}}


def constrained(obj: dict, user: str = "", **params) -> SamplingParams:
    params.setdefault("max_tokens", 32)
    return SamplingParams(structured_outputs=parse_structured_outputs(obj), user=user, **params)


def process_gone(pid: int) -> bool:
    stat = read_proc_stat(pid)
    return stat is None or stat.zombie


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not process_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def run_until_finished(engine: LLMEngine, request_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for output in engine.step().outputs:
            if output.request_id == request_id and output.finished:
                return output
    raise AssertionError(f"{request_id} did not finish in {timeout} s")


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    made = LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm"),
                                                     structured_output_compile_timeout_seconds="1"))
    assert made.structured_output.compiler.wait_started(120)  # started beside the engine, not waited for
    yield made
    made.close()


# ----------------------------------------------------------------------------------------- the budget
def test_properties_are_counted_over_the_whole_schema():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "object", "properties": {"b": {}, "c": {}}}},
                       "d": {"anyOf": [{"type": "object", "properties": {"e": {}}}, {"$ref": "#/$defs/f"}]}},
        "$defs": {"f": {"type": "object", "properties": {"g": {}, "h": {"type": "object", "properties": {"i": {}}}}}},
        "definitions": {"j": {"properties": {"k": {}}}},
        "enum": [{"properties": {"not": {}, "a": {}, "schema": {}}}],  # data, not a schema
    }
    shape = schema_shape(schema)
    assert shape.properties == 9  # a, b, c, d, e, g, h, i and k; not the enum's
    assert shape.depth == 3  # root -> a (array) -> its items (object) -> b


def test_depth_counts_nested_objects_and_arrays():
    nested: dict = {"type": "string"}
    for _ in range(5):
        nested = {"type": "array", "items": {"type": "object", "properties": {"x": nested}}}
    assert schema_shape(nested).depth == 10
    assert schema_shape({"type": "string"}).depth == 0
    assert schema_shape({"type": "object", "properties": {"a": {"type": "string"}}}).depth == 1


def test_patterns_are_pattern_keywords_and_pattern_property_names():
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x+$"}},
              "patternProperties": {"^y": {"type": "string", "pattern": "z"}},
              "propertyNames": {"pattern": "^[a-z]+$"}}
    assert sorted(p for _, p in schema_shape(schema).patterns) == ["^[a-z]+$", "^x+$", "^y", "z"]


@pytest.mark.parametrize(("obj", "expected"), [
    ({"json": many_properties(300)},
     "sampling_parameters.structured_outputs.json: 300 properties; at most 256 (parameter structured_output_max_properties)"),
    ({"json": {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^a$"} for i in range(33)}}},
     "sampling_parameters.structured_outputs.json: 33 patterns; at most 32 (parameter structured_output_max_patterns)"),
    ({"json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "a" * 1025}}}},
     "sampling_parameters.structured_outputs.json: the pattern at /properties/a/pattern has 1025 characters; at most "
     "1024 (parameter structured_output_max_pattern_length)"),
    ({"json": {"type": "object", "properties": {"a": {"enum": ["x" * 40000]}}}},
     "sampling_parameters.structured_outputs.json: 40050 bytes; at most 32768 (parameter "
     "structured_output_max_schema_bytes)"),
    ({"regex": "a" * 1025},
     "sampling_parameters.structured_outputs.regex: the regex has 1025 characters; at most 1024 (parameter "
     "structured_output_max_pattern_length)"),
    ({"grammar": 'root ::= "' + "é" * 20000 + '"'},
     "sampling_parameters.structured_outputs.grammar: 40011 bytes; at most 32768 (parameter "
     "structured_output_max_schema_bytes)"),
])
def test_a_constraint_over_the_budget_is_refused_naming_the_key_and_the_parameter(obj, expected):
    with pytest.raises(StructuredOutputError) as refused:
        check_budget(parse_structured_outputs(obj), BUDGET)
    assert str(refused.value) == expected


def test_the_depth_limit_names_its_parameter():
    nested: dict = {"type": "integer"}
    for _ in range(33):
        nested = {"type": "array", "items": nested}
    with pytest.raises(StructuredOutputError, match=r"nested 33 deep; at most 32 \(parameter structured_output_max_depth\)"):
        check_budget(parse_structured_outputs({"json": nested}), BUDGET)
    check_budget(parse_structured_outputs({"json": nested["items"]}), BUDGET)


def test_the_slow_schema_fits_the_default_budget():
    check_budget(parse_structured_outputs({"json": slow_schema("p")}), BUDGET)


def test_a_schema_over_the_budget_is_refused_before_compiling(engine):
    compiler = engine.structured_output.compiler
    compiles = compiler.num_compiles
    params = constrained({"json": many_properties(300)})
    expected = "sampling_parameters.structured_outputs.json: 300 properties; at most 256 (parameter " \
               "structured_output_max_properties)"
    with pytest.raises(EngineInputError) as checked:
        engine.check_sampling_params(params)  # the front end's check
    assert str(checked.value) == expected
    with pytest.raises(EngineInputError) as added:  # the engine core's add (the front end checked already)
        engine.add_request("too-big", prompt_token_ids=PROMPT, sampling_params=params, check=False)
    assert str(added.value) == expected
    assert compiler.num_compiles == compiles and not engine.has_unfinished_requests()


# ----------------------------------------------------------------------------------------- the timeout
def free_steps(engine: LLMEngine, seconds: float, until: str | None = None) -> tuple[list[float], dict]:
    """Steps for ``seconds`` or until request ``until`` finished: the times of the steps that gave
    request "free" a token, and the final outputs."""
    times, finals, deadline = [], {}, time.monotonic() + seconds
    while time.monotonic() < deadline and until not in finals:
        started = time.perf_counter()
        outputs = engine.step().outputs
        if any(o.request_id == "free" and o.new_token_ids for o in outputs):
            times.append(time.perf_counter() - started)
        finals.update({o.request_id: o for o in outputs if o.finished})
    return times, finals


@pytest.fixture
def one_torch_thread():
    """Steps on one core, so the worker (at a low priority) is not left waiting on a two-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_compile_past_the_timeout_fails_its_request_and_free_steps_keep_their_pace(engine, monkeypatch,
                                                                                      one_torch_thread):
    monkeypatch.setattr(compile_worker, "STALL_FACTOR", 100)  # the CPU timeout, not the backstop, on a busy machine
    engine.add_request("free", prompt_token_ids=PROMPT, sampling_params=SamplingParams(max_tokens=1900, ignore_eos=True))
    free_steps(engine, 0.3)  # warm
    alone, _ = free_steps(engine, 0.8)
    worker_pid = engine.structured_output.compiler.worker.pid
    started = time.monotonic()
    engine.add_request("slow", prompt_token_ids=PROMPT, sampling_params=constrained({"json": slow_schema("t")}))
    during, finals = free_steps(engine, 60.0, until="slow")
    elapsed = time.monotonic() - started
    assert finals["slow"].finish_reason is FinishReason.ERROR
    assert finals["slow"].error == ("sampling_parameters.structured_outputs.json: did not compile within 1 s "
                                    "(parameter structured_output_compile_timeout_seconds)")
    assert 1.0 <= elapsed < 60.0
    assert len(during) > 10
    assert statistics.median(during) < 1.5 * statistics.median(alone), (statistics.median(during),
                                                                           statistics.median(alone))
    assert wait_gone(worker_pid, 5)  # killed; a fresh worker compiles the next ones
    engine.abort_request("free")
    result = engine.generate([PROMPT], constrained({"regex": "[a-c]{4}"}))[0]
    assert result.finish_reason is FinishReason.STOP and len(result.text) == 4
    assert engine.structured_output.compiler.worker.pid != worker_pid


def test_the_timed_out_constraint_stays_refused_without_compiling_again(engine):
    schema = slow_schema("again")
    engine.add_request("first", prompt_token_ids=PROMPT, sampling_params=constrained({"json": schema}))
    assert "did not compile within 1 s" in run_until_finished(engine, "first").error
    compiles = engine.structured_output.compiler.num_compiles
    engine.add_request("repeat", prompt_token_ids=PROMPT, sampling_params=constrained({"json": schema}))
    assert "did not compile within 1 s" in run_until_finished(engine, "repeat", timeout=1.0).error
    assert engine.structured_output.compiler.num_compiles == compiles


# ----------------------------------------------------------------------------------------- per client
def test_a_client_at_its_compiles_in_flight_is_refused_while_others_are_admitted(engine):
    assert engine.structured_output.clients.max_per_client == 2
    engine.add_request("a1", prompt_token_ids=PROMPT, sampling_params=constrained({"json": slow_schema("a1_")}, "alice"))
    engine.add_request("a2", prompt_token_ids=PROMPT, sampling_params=constrained({"json": slow_schema("a2_")}, "alice"))
    with pytest.raises(EngineInputError) as refused:
        engine.add_request("a3", prompt_token_ids=PROMPT, sampling_params=constrained({"regex": "[0-9]{3}"}, "alice"))
    assert str(refused.value) == (
        "sampling_parameters.structured_outputs.regex: 2 constraints of user 'alice' are compiling already; at most 2 "
        "at once (parameter structured_output_max_compiles_per_client)")
    engine.add_request("b1", prompt_token_ids=PROMPT, sampling_params=constrained({"regex": "[0-9]{3}"}, "bob"))
    # A constraint compiling already costs no compile: never refused.
    engine.add_request("a1-again", prompt_token_ids=PROMPT,
                       sampling_params=constrained({"json": slow_schema("a1_")}, "alice"))
    assert engine.structured_output.clients.in_flight("alice") == 2
    finals = {}
    deadline = time.monotonic() + 30
    while len(finals) < 4 and time.monotonic() < deadline:
        finals.update({o.request_id: o for o in engine.step().outputs if o.finished})
    assert finals["b1"].finish_reason is FinishReason.STOP
    assert all("did not compile within" in finals[r].error for r in ("a1", "a2", "a1-again"))
    assert engine.structured_output.clients.in_flight("alice") == 0
    engine.add_request("a3", prompt_token_ids=PROMPT, sampling_params=constrained({"regex": "[0-9]{3}"}, "alice"))
    assert run_until_finished(engine, "a3").finish_reason is FinishReason.STOP


# ----------------------------------------------------------------------------------------- the worker
def test_a_worker_killed_from_outside_fails_its_compile_and_a_new_one_takes_the_next(engine):
    compiler = engine.structured_output.compiler
    schema = slow_schema("killed")
    engine.add_request("victim", prompt_token_ids=PROMPT, sampling_params=constrained({"json": schema}))
    time.sleep(0.3)  # the worker is compiling it
    old_pid = compiler.worker.pid
    os.kill(old_pid, signal.SIGKILL)
    final = run_until_finished(engine, "victim")
    assert final.error == ("sampling_parameters.structured_outputs.json: the grammar compile worker was killed by "
                           "SIGKILL while compiling it")
    assert not compiler.is_cached(parse_structured_outputs({"json": schema}))  # not the constraint's fault
    engine.add_request("next", prompt_token_ids=PROMPT, sampling_params=constrained({"regex": "[x-z]{5}"}))
    assert run_until_finished(engine, "next").finish_reason is FinishReason.STOP
    assert compiler.worker.pid != old_pid and compiler.worker.alive


def test_a_small_grammar_is_read_back_and_a_large_one_compiled_again_both_constraining(demo_model_dir, caplog):
    import xgrammar

    compiler = GrammarCompiler(load_tokenizer(str(demo_model_dir)), 8192, [2])
    try:
        small = parse_structured_outputs({"regex": "[a-c]{2}-[0-9]"})
        large = parse_structured_outputs({"json": {"type": "object", "properties": {
            f"field{i}": {"type": "string"} for i in range(200)}}, "disable_any_whitespace": True})
        with caplog.at_level(logging.DEBUG, logger="backend.structured_output.compiler"):
            grammars = [compiler.compile(spec).result(timeout=60) for spec in (small, large)]
        assert [" read back " in m for m in caplog.messages if " in the worker" in m] == [True, False]
        assert [" compiled again " in m for m in caplog.messages if " in the worker" in m] == [False, True]
        for grammar, good, bad in ((grammars[0], "ab-7", "ad-7"), (grammars[1], '{"field3": "x"}', '{"nope": 1}')):
            assert xgrammar.GrammarMatcher(grammar).accept_string(good)
            assert not xgrammar.GrammarMatcher(grammar).accept_string(bad)
    finally:
        compiler.close()


def test_close_kills_the_worker_at_once_and_cancels_what_compiles(demo_model_dir):
    compiler = GrammarCompiler(load_tokenizer(str(demo_model_dir)), 8192, [2], timeout_seconds=30)
    assert compiler.wait_started(120)
    pid = compiler.worker.pid
    compiling = compiler.compile(parse_structured_outputs({"json": slow_schema("closed")}))
    queued = compiler.compile(parse_structured_outputs({"regex": "[a-z]{3}"}))
    time.sleep(0.2)
    started = time.monotonic()
    compiler.close()
    assert time.monotonic() - started < 0.5
    assert wait_gone(pid, 5)
    with pytest.raises(Exception):  # noqa: B017  (cancelled or failed: the engine is going)
        compiling.result(timeout=5)
    assert queued.cancelled() or queued.exception(timeout=5) is not None
    compiler.close()  # idempotent


@pytest.fixture(scope="module")
def worker(demo_model_dir):
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(load_tokenizer(str(demo_model_dir)), vocab_size=8192)
    made = CompileWorker(info.serialize_json())
    made.start()
    yield made
    made.kill()


def test_the_timeout_counts_the_workers_cpu_time(worker, monkeypatch):
    monkeypatch.setattr(compile_worker, "STALL_FACTOR", 100)
    spec = parse_structured_outputs({"json": slow_schema("cpu")})
    pid = worker.pid
    started = time.monotonic()
    with pytest.raises(CompileTimeout) as timed_out:
        worker.compile(spec, timeout=1)
    assert str(timed_out.value) == ("sampling_parameters.structured_outputs.json: did not compile within 1 s "
                                    "(parameter structured_output_compile_timeout_seconds)")
    assert time.monotonic() - started >= 1.0 and wait_gone(pid, 5) and not worker.alive
    worker.start()
    worker.compile(parse_structured_outputs({"regex": "[a-z]{2}"}), timeout=10)


def test_a_worker_given_no_cpu_is_stopped_by_the_wall_clock_backstop(worker):
    os.kill(worker.pid, signal.SIGSTOP)  # as a machine too busy to run it
    started = time.monotonic()
    with pytest.raises(CompileInterrupted, match="did not compile within 1.5 s: the machine is too busy"):
        worker.compile(parse_structured_outputs({"regex": "[a-z]{3}"}), timeout=0.5)
    assert 1.5 <= time.monotonic() - started < 3 and not worker.alive
    worker.start()


def test_the_worker_and_its_fork_server_run_at_the_low_priority_and_the_engine_does_not(worker):
    """The fork server lowers its priority before its heavy imports (fork_server_priority.py), its
    workers keep that value (not lower still), and the process that started them keeps its own."""
    def nice(pid: int) -> int:
        return read_proc_stat(pid).nice

    fork_server = read_proc_stat(worker.pid).ppid
    assert nice(worker.pid) == compile_worker.NICE
    assert nice(fork_server) == compile_worker.NICE and fork_server != os.getpid()
    assert nice(os.getpid()) < compile_worker.NICE


def test_a_fork_server_still_importing_ends_with_the_process_that_started_it(tmp_path):
    """multiprocessing's fork server watches its parent only after its preload, which at the low
    priority on a busy machine takes tens of seconds: fork_server_priority.py watches from the start.
    Here the preload after it sleeps a minute, and its parent exits at once."""
    (tmp_path / "slow_preload.py").write_text("import time\ntime.sleep(60)\n")
    starter = (
        "import multiprocessing, multiprocessing.forkserver as fs, os\n"
        "multiprocessing.set_forkserver_preload(['backend.structured_output.fork_server_priority', 'slow_preload'])\n"
        "fs._forkserver.ensure_running()\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(fs._forkserver._forkserver_pid))\n"
        "os._exit(0)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    # its output goes nowhere: the fork server inherits it, and a pipe would wait for the fork server
    subprocess.run([sys.executable, "-c", starter], stdout=subprocess.DEVNULL, timeout=60, check=True, env=env)
    fork_server = int((tmp_path / "pid").read_text())
    assert wait_gone(fork_server, 10), "the fork server outlived its parent while importing"


def test_a_worker_whose_engine_leaves_before_it_is_ready_exits_quietly():
    """An engine stopped right after its start closes the pipe before the tokenizer info is sent:
    the worker ends with code 0 and no traceback (an EOFError used to end it with code 1)."""
    context = compile_worker._context()
    parent, child = context.Pipe()
    process = context.Process(target=compile_worker.serve, args=(child, os.getpid()), daemon=True)
    process.start()
    child.close()
    parent.close()
    process.join(60)
    assert process.exitcode == 0


def test_a_worker_that_cannot_start_fails_loudly():
    with pytest.raises(CompileWorkerError, match="exited with code 1 before it was ready"):
        CompileWorker("not the tokenizer info").start()


def test_an_engine_whose_worker_cannot_start_serves_and_fails_only_constrained_requests(demo_model_dir, monkeypatch):
    """The worker starts beside the engine (an engine start, and a model's recovery, do not wait
    for it): one that cannot start costs constrained requests an error naming it, nothing else."""
    import xgrammar

    monkeypatch.setattr(xgrammar.TokenizerInfo, "serialize_json", lambda self: "not the tokenizer info")
    engine = LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm")))
    try:
        assert engine.structured_output.compiler.wait_started(120)
        engine.add_request("constrained", prompt_token_ids=PROMPT, sampling_params=constrained({"regex": "[a-z]{2}"}))
        assert "the grammar compile worker could not be started" in run_until_finished(engine, "constrained").error
        free = engine.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert free.error is None and len(free.output_token_ids) == 4
    finally:
        engine.close()


# ----------------------------------------------------------------------------------------- the core process
def descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (the engine core's fork server, its workers, ...)."""
    children: dict[int, list[int]] = {}
    for child in all_pids():
        stat = read_proc_stat(child)
        if stat is not None and not stat.zombie:
            children.setdefault(stat.ppid, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@pytest.mark.parametrize("how", ["shutdown", "kill -9"])
def test_the_engine_core_leaves_no_compile_worker_behind(demo_model_dir, how):
    from backend.engine_core.process_client import ProcessClient

    client = ProcessClient(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm")), 4, heartbeat_timeout=30)
    client.start()
    try:
        core = client.core_pid
        deadline = time.monotonic() + 60  # the worker starts beside the core, not before it is ready
        while len(under := descendants(core)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert under, "the engine core has no compile worker"
        started = time.monotonic()
        if how == "shutdown":
            client.stop(timeout=10)
            assert time.monotonic() - started < 10
        else:
            os.kill(core, signal.SIGKILL)
        assert all(wait_gone(pid, 10) for pid in under | {core}), "a process outlived the engine core"
    finally:
        client.stop(timeout=10)
