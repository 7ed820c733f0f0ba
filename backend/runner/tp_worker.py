"""A tensor-parallel worker: ``python -m backend.runner.tp_worker SPEC_FILE`` (rank 1..N-1).

Started by rank 0 (backend/parallel/driver.py) with rank 0's own interpreter. It joins the group,
loads its shard of the model and allocates its share of the KV cache (the same block count as rank
0), says ``ready`` on its status pipe, and then runs what rank 0 sends down stdin, in order:
``forward`` (one step's batch), ``logits`` (its vocabulary columns of the given rows, gathered on
rank 0), ``copy`` (copy-on-write blocks), ``shutdown``. It holds no scheduler and no requests.
It exits when stdin closes (rank 0 is gone) or when its parent process changes (rank 0 killed).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time

PARENT_POLL_SECONDS = 0.5

logger = logging.getLogger("backend.runner.tp_worker")


def watch_parent(parent_pid: int) -> None:
    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(0)

    threading.Thread(target=run, name="tp-parent-watch", daemon=True).start()


def read_command(stream):
    from backend.parallel.driver import HEADER  # noqa: PLC0415 (process: after the parent watch started; torch takes seconds to import)

    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (length,) = HEADER.unpack(header)
    return pickle.loads(stream.read(length))  # rank 0's own objects, over a pipe only it holds


def serve(runner, stream) -> None:
    """Runs rank 0's commands until shutdown or end of input."""
    import torch  # noqa: PLC0415 (process: after the parent watch started; torch takes seconds to import)

    from backend.runner.model_runner import select_rows  # noqa: PLC0415 (process: after the parent watch started; torch takes seconds to import)

    model, hidden = runner.model, None
    with torch.inference_mode():
        while True:
            command = read_command(stream)
            if command is None or command[0] == "shutdown":
                return
            name = command[0]
            if name == "forward":
                _, input_ids, positions, metadata, row_adapters = command
                if runner.lora is not None:  # this rank's part of the step's adapters, loaded on first use
                    for adapter in set(row_adapters) - {None}:
                        runner.lora.require(adapter)
                    runner.lora_hook.step = runner.lora.step_for(row_adapters, metadata.num_decodes)
                try:
                    hidden = model(input_ids, positions, runner.kv_caches, metadata)
                finally:
                    if runner.lora is not None:
                        runner.lora_hook.step = None
            elif name == "logits":
                model.compute_logits(select_rows(hidden, command[1]))  # this rank's columns go to rank 0
            elif name == "copy":
                runner.block_io.copy(command[1], command[2])
            else:
                raise ValueError(f"unknown command {name!r}")


def main(argv: list[str]) -> int:
    with open(argv[1], "rb") as handle:
        spec = pickle.load(handle)  # written by rank 0 into its private folder
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"tp-rank{spec.rank}[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    watch_parent(spec.parent_pid)
    status = os.fdopen(spec.status_fd, "w", buffering=1)
    import torch  # noqa: PLC0415 (process: after the parent watch started; torch takes seconds to import)

    from backend.parallel import group  # noqa: PLC0415 (process: after the parent watch started; torch takes seconds to import)
    from backend.runner.model_runner import ModelRunner, resolve_device  # noqa: PLC0415 (process: after the parent watch started; torch takes seconds to import)

    device = group.rank_device(resolve_device(spec.model_config.device), spec.rank)
    if device.type == "cpu":
        group.pin(spec.rank, spec.cores)
    status.write("up\n")
    shard = group.join(spec.rank, spec.size, spec.rendezvous_file, device, spec.shm_file,
                       [spec.parent_pid] + [0] * (spec.size - 1))  # rank 0 watches the others
    try:
        runner = ModelRunner.load_rank(spec.model_config, spec.block_size, spec.num_blocks, shard, device)
    except Exception as exc:  # noqa: BLE001 - said to rank 0, which fails the start with it
        logger.exception("loading the shard failed")
        status.write(f"failed: {type(exc).__name__}: {exc}".replace("\n", " ") + "\n")
        return 1
    if spec.lora_config is not None and spec.lora_config.enable_lora:
        from backend.lora.manager import LoRAManager  # noqa: PLC0415 (process: after the parent watch started; torch takes seconds to import)

        runner.attach_lora(LoRAManager(spec.lora_config, runner.model.full_shape, runner.dtype, runner.device,
                                       live=set, shard=shard, local_shape=runner.shape))
    status.write("ready\n")
    status.close()
    logger.info("rank %d of %d ready on %s: %d KV blocks, %d torch threads", spec.rank, spec.size, device,
                spec.num_blocks, torch.get_num_threads())
    serve(runner, sys.stdin.buffer)
    group.leave(shard)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
