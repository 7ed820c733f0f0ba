"""``python -m openai_front --triton-url HOST:PORT --model llm [--port 9000]``: the front alone.

``make serve`` starts it beside tritonserver (backend/server/launcher.py); run it by hand to put
it in front of a tritonserver started elsewhere.
"""

from __future__ import annotations

import argparse
import os
import sys

import uvicorn

from openai_front.app import FrontSettings, create_app
from openai_front.auth import ApiKeys
from openai_front.protocol import Limits
from openai_front.reasoning import PARSERS

DEFAULT_PORT = 9000  # the port of Triton's own OpenAI-compatible frontend
API_KEY_ENV = "OPENAI_FRONT_API_KEY"  # keys here stay off the command line (and out of ps)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m openai_front", description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton-url", default="localhost:8001", help="tritonserver's gRPC address")
    parser.add_argument("--model", default="llm", help="the Triton model, and the name clients send")
    parser.add_argument("--host", default="127.0.0.1", help="the address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--max-concurrent", type=int, default=256, help="generations in flight; beyond: 503")
    parser.add_argument("--max-n", type=int, default=8, help="the largest n a request may ask for")
    parser.add_argument("--max-tokens", type=int, default=8192, help="the largest max_tokens a request may ask for")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--idle-timeout", type=float, default=300.0,
                        help="seconds of silence from Triton after which a generation fails (504)")
    parser.add_argument("--keep-alive-timeout", type=float, default=5.0, help="idle HTTP keep-alive seconds")
    parser.add_argument("--max-streams-per-client", type=int, default=0,
                        help="one client's generations in flight (its API key's name, else its user field); "
                             "beyond: 429; 0: no cap")
    parser.add_argument("--api-key", action="append", default=None, metavar="[NAME=]KEY",
                        help="require Authorization: Bearer KEY (repeat for several keys; default: the "
                             f"{API_KEY_ENV} environment variable, comma-separated; none: no key needed)")
    parser.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                        help="split chat answers' <think> reasoning from their content (default: the model's "
                             "reasoning_parser parameter; none: no split)")
    parser.add_argument("--log-level", default="warning")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("max_concurrent", "max_n", "max_tokens", "max_body_bytes"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')}: must be >= 1", file=sys.stderr)
            return 2
    if args.max_streams_per_client < 0:
        print("error: --max-streams-per-client: must be >= 0", file=sys.stderr)
        return 2
    keys = args.api_key if args.api_key is not None else [k for k in os.environ.get(API_KEY_ENV, "").split(",") if k]
    try:
        api_keys = ApiKeys(keys)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = FrontSettings(args.triton_url, args.model, Limits(args.max_n, args.max_tokens), args.max_concurrent,
                             args.max_body_bytes, args.idle_timeout, args.max_streams_per_client, api_keys,
                             args.reasoning_parser)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                timeout_keep_alive=args.keep_alive_timeout, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
