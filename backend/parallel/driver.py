"""Rank 0's side of a tensor-parallel group: starts the workers, hands them each step's plan, and
watches them.

Rank 0 is the process that owns the engine (the engine-core process when served). It keeps the
scheduler, the sampler and the outputs; the workers (backend/runner/tp_worker.py) hold only their
shard of the model and of the KV cache, with the same block ids. Each step rank 0 sends every
worker one message (the flattened batch: token ids, positions, attention metadata) and then runs
its own shard; the layers' collectives meet inside the forward. Logits are gathered on rank 0, so
the rows to score are a second, small message (one per ``compute_logits``: sampling, and prompt
logprobs in slices). Copy-on-write block copies are mirrored the same way.

The messages go down each worker's stdin (length-prefixed pickles of our own objects), not through
a torch.distributed broadcast: a worker idles in a blocking read for as long as nobody sends
requests, where a collective would time out, and a rank 0 that dies closes the pipe, so its
workers end with it. A watcher thread polls the workers; a worker that exits or is killed makes
the next step (or the one in flight, whose collective then fails) raise ``WorkerLost`` naming the
rank and how it ended. The engine treats that as fatal: served, the engine-core process exits and
its front end fails the requests in flight and restarts every rank (backend/engine_core).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

from backend.parallel import group
from backend.parallel.shm import create_file
from backend.process_exit import describe_exit_code

logger = logging.getLogger(__name__)

START_TIMEOUT_SECONDS = 300.0  # a worker loads its shard in this time or the start fails
WATCH_SECONDS = 0.05
HEADER = struct.Struct("<Q")


class WorkerLost(RuntimeError):
    """A tensor-parallel worker died: the group cannot compute another step."""


class WorkerStartError(RuntimeError):
    """A worker could not load its shard (its message says why) or did not start in time."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its rank (pickled into a file only this group reads)."""

    model_config: object  # backend.config.ModelConfig
    block_size: int
    num_blocks: int
    rank: int
    size: int
    rendezvous_file: str
    status_fd: int  # the worker writes 'up', then 'ready' or 'failed: ...' lines here
    parent_pid: int
    shm_file: str | None  # the shared-memory collectives' file (CPU), see shm.py
    cores: list[int]  # the cores the group runs on, one per rank (CPU), see group.pin
    lora_config: object | None  # backend.config.LoRAConfig when adapters are served


def _frame(command: tuple) -> bytes:
    """One command as the worker reads it (worker.read_command): its length, then its pickle."""
    data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


class TensorParallelDriver:
    def __init__(self, model_config, block_size: int, num_blocks: int, size: int, device: torch.device,
                 cores: list[int], lora_config=None):
        """Starts ranks 1..size-1 (each pinned to its core of ``cores`` on a CPU) and joins the group
        as rank 0 (returns once all have joined)."""
        self.size = size
        self.lost: str | None = None
        self._closed = False
        self._workdir = tempfile.mkdtemp(prefix="llm-tp-")
        rendezvous = os.path.join(self._workdir, "rendezvous")
        self.workers: list[subprocess.Popen] = []
        self._status: list[int] = []  # read ends of the workers' status pipes
        self._shm_file = None
        self.shard = None
        try:
            if device.type == "cpu":
                self._shm_file = create_file(size)
            for rank in range(1, size):
                read_fd, write_fd = os.pipe()
                spec = WorkerSpec(model_config, block_size, num_blocks, rank, size, rendezvous, write_fd, os.getpid(),
                                  self._shm_file, cores, lora_config)
                path = os.path.join(self._workdir, f"rank{rank}.pkl")
                with open(path, "wb") as handle:
                    pickle.dump(spec, handle)
                self.workers.append(subprocess.Popen(
                    [sys.executable, "-m", "backend.runner.tp_worker", path], stdin=subprocess.PIPE,
                    pass_fds=(write_fd,), cwd=os.getcwd()))
                os.close(write_fd)
                self._status.append(read_fd)
            self._expect("up")
            self.shard = group.join(0, size, rendezvous, device, self._shm_file,
                                    [0, *(worker.pid for worker in self.workers)])
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._watch, name="tp-worker-watch", daemon=True).start()

    # ----------------------------------------------------------------------------- start-up
    def _expect(self, word: str, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """Waits for every worker's next status line to be ``word``; raises WorkerStartError with
        a worker's own message (or how it ended) otherwise."""
        deadline = time.monotonic() + timeout
        for rank, fd in enumerate(self._status, start=1):
            line = b""
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerStartError(f"tensor-parallel rank {rank} did not start within {timeout:g} s")
                ready, _, _ = select.select([fd], [], [], min(left, 0.5))
                if not ready:
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:
                    code = self.workers[rank - 1].wait(5)
                    raise WorkerStartError(f"tensor-parallel rank {rank} {describe_exit_code(code)} while starting")
                line += chunk
            text = line.decode("utf-8", "replace").strip()
            if text != word:
                raise WorkerStartError(f"tensor-parallel rank {rank}: {text.removeprefix('failed: ')}")

    def wait_ready(self) -> None:
        """Returns once every worker has loaded its shard and its KV cache."""
        self._expect("ready")
        for fd in self._status:
            os.close(fd)
        self._status = []
        self._unlink_shm()  # every rank has it mapped: nothing is left behind if one is killed

    def _unlink_shm(self) -> None:
        if self._shm_file is not None:
            try:
                os.unlink(self._shm_file)
            except FileNotFoundError:
                pass
            self._shm_file = None

    # ----------------------------------------------------------------------------- each step
    def send(self, *command) -> None:
        """Hands every worker ``command`` (a tuple: name, arguments); raises WorkerLost."""
        self.raise_if_lost()
        frame = _frame(command)
        for rank, worker in enumerate(self.workers, start=1):
            try:
                worker.stdin.write(frame)
                worker.stdin.flush()
            except (BrokenPipeError, OSError):
                self.raise_if_lost(wait=1.0)
                raise WorkerLost(f"tensor-parallel rank {rank} stopped reading its steps") from None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata, row_adapters=None) -> None:
        """``row_adapters``: each row's LoRA adapter name (None: the base model), or None without LoRA."""
        self.send("forward", input_ids, positions, metadata, row_adapters)

    def logits(self, rows) -> None:
        """``rows``: None (every row of the last forward), an index tensor, or a (start, end) slice."""
        self.send("logits", rows)

    def copy_blocks(self, source_ids, destination_ids) -> None:
        self.send("copy", list(source_ids), list(destination_ids))

    def raise_if_lost(self, wait: float = 0.0) -> None:
        """Raises WorkerLost once a worker has died (waiting up to ``wait`` s for the watcher to see it)."""
        deadline = time.monotonic() + wait
        while self.lost is None and time.monotonic() < deadline:
            time.sleep(WATCH_SECONDS)
        if self.lost is not None:
            raise WorkerLost(self.lost)

    def _watch(self) -> None:
        while not self._closed:
            for rank, worker in enumerate(self.workers, start=1):
                code = worker.poll()
                if code is not None and self.lost is None and not self._closed:
                    self.lost = f"tensor-parallel rank {rank} (pid {worker.pid}) {describe_exit_code(code)}"
                    logger.error("%s: the group cannot run another step", self.lost)
            time.sleep(WATCH_SECONDS)

    # ----------------------------------------------------------------------------- shutdown
    def close(self, timeout: float = 10.0) -> None:
        """Stops the workers (a shutdown message, then SIGKILL) and leaves the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:
            try:
                if worker.poll() is None:
                    worker.stdin.write(_frame(("shutdown",)))
                    worker.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            try:
                worker.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        for fd in self._status:
            os.close(fd)
        self._status = []
        self._unlink_shm()
        group.leave(self.shard)
        shutil.rmtree(self._workdir, ignore_errors=True)

    def kill(self) -> None:
        """Every worker at once (rank 0 is going down)."""
        self._closed = True
        for worker in self.workers:
            if worker.poll() is None:
                worker.kill()
