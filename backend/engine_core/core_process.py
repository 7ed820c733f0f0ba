"""The engine-core process: ``python -m backend.engine_core.core_process WORKDIR``.

Started by the front end (backend/engine_core/process_handle.py) with the front end's own
interpreter. It owns the engine (runner, scheduler, KV cache, sampler; detokenization and stop
strings too, see ``process_client``'s docstring for why) and runs one loop on its main thread:

1. take every message waiting on the input socket (without waiting when there is work);
2. ``EngineCore.iterate``: adds, aborts, the drain deadline, one step;
3. send one ``CoreOutputs`` with all of the step's outputs, or a heartbeat when it has been quiet
   for ``HEARTBEAT_SECONDS`` (the front end declares a silent core hung).

It never waits on the front end: sends are non-blocking into an unbounded queue. It exits when
asked (``CoreInput.shutdown``; its compile worker's processes are reaped first, so a stopped server
leaves none behind), when a rank of its tensor-parallel group dies (it writes why in
``EXIT_REASON_FILE`` for the front end's error, which then restarts it and so every rank), and on
its own when its parent is gone (a killed tritonserver leaves no orphan core, nor its compile
worker's processes): a daemon thread
watches the parent pid. A parent that died while its model
was still serving (a killed stub) first gets tritonserver stopped, see ``stub_watch``.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time

import zmq

from backend.engine_core.core import EngineCore
from backend.engine_core.stub_watch import on_stub_death
from backend.protocol.messages import (
    EXIT_REASON_FILE,
    CoreFailed,
    CoreOutputs,
    CoreReady,
    encoder,
    input_decoder,
)
from backend.structured_output.compile_worker import end_fork_server, end_resource_tracker

HEARTBEAT_SECONDS = 0.5
PARENT_POLL_SECONDS = 0.1  # a dead stub's recovery starts this soon at worst (a getppid call per poll)
EXIT_RANK_LOST = 3

logger = logging.getLogger("backend.engine_core")


def watch_parent(parent_pid: int, stub_watch=None) -> None:
    """Exits this process at once when the parent goes (it is re-parented, so getppid changes),
    after ``stub_watch.on_stub_death`` when the front end asked for it, and after ending the
    compile worker's processes, which would otherwise outlive it by seconds."""

    def run() -> None:
        while True:
            if os.getppid() != parent_pid:
                on_stub_death(stub_watch)
                end_compile_processes()
                os._exit(0)
            time.sleep(PARENT_POLL_SECONDS)

    threading.Thread(target=run, name="engine-core-parent-watch", daemon=True).start()


def end_compile_processes() -> None:
    """The grammar compile worker's fork server (with its workers) and multiprocessing's resource
    tracker, if this process started them: for an exit that skips the engine's own shutdown. One
    still importing at its low priority would notice this process's end only seconds later."""
    if "multiprocessing.forkserver" not in sys.modules:
        return

    try:
        end_fork_server()
        end_resource_tracker(timeout=1.0)
    except Exception:  # best effort on the way out: the exit must happen
        logger.exception("ending the compile worker's processes")


def bind_torch_threads() -> int:
    """One torch thread per core this process may run on (what the affinity mask allows)."""
    import torch  # noqa: PLC0415 (process: after the parent watch started; torch takes seconds to import)

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    return cores


def serve(core, input_socket, output_socket, autostep: bool) -> None:
    """The loop (see the module docstring); returns after a shutdown message."""
    encode, decode = encoder().encode, input_decoder().decode
    poller = zmq.Poller()
    poller.register(input_socket, zmq.POLLIN)
    last_sent = time.monotonic()

    def send(outputs, stepped: bool, final: bool = False, answers: int = 0) -> None:
        nonlocal last_sent
        message = CoreOutputs(outputs, core.stats(), core.num_adds_seen, time.monotonic(), stepped, final, answers)
        output_socket.send(encode(message), copy=False)
        last_sent = message.sent_at

    while True:
        busy = autostep and core.has_work()
        if not busy:
            poller.poll(HEARTBEAT_SECONDS * 1000)
        adds, aborts, step_asked, shutdown, taken = [], [], False, None, 0
        while True:
            try:
                frame = input_socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            message = decode(frame.buffer)
            taken += 1
            adds.extend(message.adds)
            aborts.extend(message.aborts)
            step_asked = step_asked or message.step
            if message.drain_grace is not None:
                core.begin_drain(message.drain_grace)
            if message.shutdown is not None:
                shutdown = message.shutdown
        if shutdown is not None:
            outputs = core.fail_everything(shutdown, adds)
            core.engine.close()  # before the final message: the front end then ends this process
            if core.engine.structured_output is not None:  # no compile worker process outlives this one
                core.engine.structured_output.end_processes()
            send(outputs, stepped=False, final=True, answers=taken)
            return
        stepped = (autostep or step_asked) and (bool(adds) or core.has_work())
        outputs = core.iterate(adds, aborts, step=autostep or step_asked)
        if outputs or taken or stepped or time.monotonic() - last_sent >= HEARTBEAT_SECONDS:
            send(outputs, stepped=stepped, answers=taken)


def main(argv: list[str]) -> int:
    workdir = argv[1]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"engine-core[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    with open(os.path.join(workdir, "spec.pkl"), "rb") as handle:
        spec = pickle.load(handle)  # written by process_handle.CoreProcess: our own file
    watch_parent(spec["parent_pid"], spec.get("stub_watch"))

    context = zmq.Context()
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)  # never block the core on a slow front end
    output_socket.setsockopt(zmq.LINGER, 2000)
    output_socket.connect(spec["output_address"])
    input_socket = context.socket(zmq.PULL)
    input_socket.setsockopt(zmq.RCVHWM, 0)
    input_socket.connect(spec["input_address"])
    try:
        threads = bind_torch_threads()
        from backend.engine.llm_engine import LLMEngine  # noqa: PLC0415 (process: after the parent watch started; torch takes seconds to import)

        engine = LLMEngine(spec["config"])
        core = EngineCore(engine)
    except Exception as exc:
        logger.exception("the engine core could not start")
        output_socket.send(encoder().encode(CoreFailed(f"{type(exc).__name__}: {exc}")))
        output_socket.close()
        context.term()
        return 1
    logger.info("ready: %d torch threads, %d KV blocks", threads, engine.num_kv_blocks)
    output_socket.send(encoder().encode(CoreReady(os.getpid(), engine.vocab_size, engine.max_model_len,
                                                  engine.num_kv_blocks)))
    from backend.parallel.driver import WorkerLost  # noqa: PLC0415 (process: after the parent watch started; torch takes seconds to import)

    try:
        serve(core, input_socket, output_socket, autostep=spec["autostep"])
    except WorkerLost as exc:  # a tensor-parallel rank died: this core ends, its front end restarts every rank
        logger.error("%s: exiting so that every rank is restarted", exc)
        with open(os.path.join(workdir, EXIT_REASON_FILE), "w", encoding="utf-8") as handle:
            handle.write(str(exc))
        engine.model_runner.tensor_parallel.kill()
        os._exit(EXIT_RANK_LOST)
    input_socket.close(linger=0)
    output_socket.close()
    context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
