"""python -m client.batch INPUT.jsonl OUTPUT.jsonl: an OpenAI-format batch file through the `llm` model.

    python -m client.batch requests.jsonl results.jsonl [--url localhost:8001] [--concurrency 64]
        [--order completion|input] [--validate-json] [--post-process MODULE:FUNCTION]

One request per input line (``custom_id``, ``url``, ``body`` with ``messages`` or ``prompt``), one
result per output line (``custom_id``, ``response`` or ``error``). Rerunning with the same OUTPUT
resumes: lines already there are skipped. ``--validate-json`` fails lines whose output is not JSON
or, when the request gave a schema (``response_format`` json_schema, ``structured_outputs``,
``guided_json``), does not validate against it; ``--post-process`` adds a check of your own: a
function of (request, text) returning None or (error code, message). Progress every few seconds,
a summary at the end (``--summary-json`` also writes it).

Requests go at ``--priority`` (default 1: after interactive traffic at the default 0, where the
model's ``scheduling_policy`` is ``priority``; a line's own ``body.priority`` wins).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from client.batch.runner import BatchRunner, load_check, validate_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.batch", description=__doc__.splitlines()[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", type=Path, help="JSONL, one OpenAI batch request per line")
    parser.add_argument("output", type=Path, help="JSONL results; an existing file is resumed")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default: %(default)s)")
    parser.add_argument("--model", default="llm", help="model name (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="requests in flight; the llm model's max_num_seqs keeps it saturated (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default: %(default)s)")
    parser.add_argument("--order", choices=("completion", "input"), default="completion",
                        help="output order: as results arrive, or rewritten in input order at the end")
    parser.add_argument("--validate-json", action="store_true", help="fail outputs that are not JSON (or miss their schema)")
    parser.add_argument("--post-process", action="append", default=[], metavar="MODULE:FUNCTION",
                        help="another check of each output (repeatable)")
    parser.add_argument("--priority", type=int, default=1,
                        help="request priority, lower first (default: %(default)s; 0 sends none)")
    parser.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines (0: off)")
    parser.add_argument("--summary-json", type=Path, default=None, help="write the summary here too")
    args = parser.parse_args(argv)
    if not args.input.exists():
        parser.error(f"{args.input}: no such file")
    checks = ([validate_json] if args.validate_json else []) + [load_check(spec) for spec in args.post_process]
    runner = BatchRunner(args.url, args.model, args.concurrency, args.timeout, checks, args.progress_interval,
                         args.priority)
    summary = runner.run(args.input, args.output, args.order)
    print(summary.table())
    if args.summary_json is not None:
        args.summary_json.write_text(json.dumps(summary.as_dict(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
