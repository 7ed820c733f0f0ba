"""What publishing KV-cache events costs the engine's step, with subscribers that misbehave.

The same workload runs in-process (perf.engine_driver) with events off, and on with: nobody
subscribed; a subscriber that connects and never reads (its queue fills, PUB drops); a subscriber
that reads the first steps and then goes away. Modes alternate within each round; the table gives
medians over rounds of the mean step time and of output tokens per second, and the batches the
engine published and dropped.

    python -m perf.kv_events_cost [--model-folder model_repository/llm] [--rounds 3]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import zmq

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.paths import REPO_ROOT
from client.bench.metadata import git_state, machine_info, now_iso
from client.bench.report import write_json
from perf import engine_driver

MODES = ("off", "no subscriber", "never reads", "leaves after 5 steps")


def free_endpoint() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


class Subscriber:
    """A SUB socket that reads (or not) what the engine publishes, and may leave."""

    def __init__(self, context: zmq.Context, address: str, reads: bool, leave_after_steps: int | None) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, 4)  # a reader that never reads fills this at once
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(address)
        self.reads = reads
        self.leave_after_steps = leave_after_steps
        self.steps = 0

    def on_step(self, _step) -> None:
        self.steps += 1
        if self.socket.closed:
            return
        if self.reads:
            while self.socket.poll(0):
                self.socket.recv_multipart()
        if self.leave_after_steps is not None and self.steps >= self.leave_after_steps:
            self.socket.close(linger=0)


def run_mode(mode: str, folder: str, overrides: dict[str, str], requests) -> dict:
    events = mode != "off"
    address = free_endpoint()
    config = engine_config_from_model_folder(folder, **overrides, **({"kv_events_endpoint": address} if events else {}))
    engine = LLMEngine(config)
    context = zmq.Context()
    subscriber = None
    if mode == "never reads":
        subscriber = Subscriber(context, address, reads=False, leave_after_steps=None)
    elif mode.startswith("leaves"):
        subscriber = Subscriber(context, address, reads=True, leave_after_steps=5)
    try:
        engine_driver.warm_up(engine, requests[0][0])
        time.sleep(0.2)  # a subscriber's connection is up before the measured steps
        steps = []
        run = engine_driver.run(engine, requests, on_step=lambda step: steps.append(step) or (
            subscriber.on_step(step) if subscriber is not None else None))
        stats = engine.stats()
        tokens = sum(record.num_output_tokens for record in run.records)
        return {"mode": mode, "steps": len(steps), "step_ms": 1000 * run.duration_s / max(1, len(steps)),
                "tokens_per_s": tokens / run.duration_s, "published": stats.kv_events_published_batches,
                "dropped": stats.kv_events_dropped_batches}
    finally:
        if subscriber is not None and not subscriber.socket.closed:
            subscriber.socket.close(linger=0)
        context.term()
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.kv_events_cost", description=__doc__.split("\n\n")[0])
    engine_driver.add_model_folder_argument(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", default="uniform:64:512")
    parser.add_argument("--output-len", default="32")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=str(REPO_ROOT / "perf" / "results" / "kv_events_cost.json"))
    args = parser.parse_args(argv)
    overrides = {"dtype": args.dtype}
    config = engine_config_from_model_folder(args.model_folder, **overrides)
    requests = engine_driver.token_workload(engine_driver.prompt_builder(config), args.num_requests, args.input_len,
                                            args.output_len, seed=32, max_model_len=config.model.max_model_len)
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        for mode in MODES:
            result = run_mode(mode, args.model_folder, overrides, requests)
            results[mode].append(result)
            print(f"round {round_index + 1}/{args.rounds} {mode}: {result['step_ms']:.1f} ms/step, "
                  f"{result['tokens_per_s']:.1f} tok/s, published {result['published']}, dropped {result['dropped']}",
                  flush=True)
    lines = ["| events | step ms (median) | output tok/s (median) | batches published | dropped |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for mode, runs in results.items():
        lines.append(f"| {mode} | {statistics.median(r['step_ms'] for r in runs):.1f} | "
                     f"{statistics.median(r['tokens_per_s'] for r in runs):.1f} | "
                     f"{statistics.median(r['published'] for r in runs):.0f} | "
                     f"{statistics.median(r['dropped'] for r in runs):.0f} |")
    table = "\n".join(lines)
    print(table)
    document = {"tool": "perf.kv_events_cost", "created": now_iso(), "git": git_state(), "machine": machine_info(),
                "model_dir": config.model.model_dir, "dtype": args.dtype, "settings": vars(args), "runs": results,
                "table": table}
    write_json(document, args.out)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
