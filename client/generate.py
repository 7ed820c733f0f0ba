"""Stream one generation from the `llm` model and print it as it arrives.

    python -m client.generate "The quick brown fox" --max-tokens 64 [--url localhost:8001] [--json]
        [--session-id ID]
    python -m client.generate --chat "What is the capital of France?" [--system "Answer briefly."]

``--chat`` sends the prompt as a user message (the ``messages`` input), which the server renders
with the model's chat template.

Every stream carries the routing header of client.routing (``x-session-id``): the session id when
given, otherwise a stable hash of the prompt's first block of text, so that behind nginx
(deploy/nginx.conf) the same session or prefix reaches the same replica and its prefix cache.

Ends with time to first token and tokens per second (client-side, gRPC streaming). ``--json``
prints one machine-readable object instead of the streamed text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from client.routing import routing_headers
from client.stream import StreamingClient


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client.generate", description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default: %(default)s)")
    parser.add_argument("--model", default="llm", help="model name (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=None, help="output length cap (server default if unset)")
    parser.add_argument("--min-tokens", type=int, default=None, help="minimum output tokens (EOS ignored before)")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None, help="0 = off")
    parser.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--no-stream", action="store_true", help="one response with all the text")
    parser.add_argument("--include-prompt", action="store_true", help="echo the prompt (exclude_input_in_output=false)")
    parser.add_argument("--sampling-parameters", default=None, help="JSON object with vLLM-style keys")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a chat user message (the model's chat template renders it)")
    parser.add_argument("--system", default=None, help="with --chat: a system message before the user's")
    parser.add_argument("--session-id", default=None,
                        help="routing header for replica affinity (default: a hash of the prompt's first block)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    options = dict(
        max_tokens=args.max_tokens, min_length=args.min_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, random_seed=args.seed, stop_words=args.stop,
        ignore_eos=True if args.ignore_eos else None, stream=not args.no_stream,
        exclude_input_in_output=False if args.include_prompt else None,
        sampling_parameters=args.sampling_parameters,
    )
    text_input = prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}]
        options["messages"], text_input = messages, None

    printed = 0

    def show(_rid, result):
        nonlocal printed
        if not args.json:
            sys.stdout.write(result.text[printed:])
            sys.stdout.flush()
            printed = len(result.text)

    try:
        headers = routing_headers(prompt, session_id=args.session_id)
        with StreamingClient(args.url, args.model, headers=headers) as client:
            start = time.monotonic()
            rid = client.send(text_input, **options)
            result = client.collect([rid], {rid: start}, args.timeout, on_response=show)[rid]
    except Exception as exc:  # connection refused, timeouts: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    elapsed = result.end_time - result.start_time
    num_tokens = result.num_output_tokens if result.num_output_tokens is not None else len(result.token_ids)
    decode_time = (result.end_time - result.first_token_time) if result.first_token_time else 0.0
    summary = {
        "text": result.text,
        "finish_reason": result.finish_reason,
        "num_input_tokens": result.num_input_tokens,
        "num_output_tokens": num_tokens,
        "ttft_s": result.ttft,
        "e2e_s": elapsed,
        "tokens_per_s": num_tokens / elapsed if elapsed > 0 else None,
        "decode_tokens_per_s": (num_tokens - 1) / decode_time if decode_time > 0 and num_tokens > 1 else None,
        "error": result.error,
    }
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    elif result.error:
        print(f"\nerror: {result.error}", file=sys.stderr)
    else:
        ttft = f"{result.ttft * 1000:.1f} ms" if result.ttft is not None else "n/a"
        rate = f"{summary['tokens_per_s']:.1f}" if summary["tokens_per_s"] else "n/a"
        print(
            f"\n--\nfinish_reason={result.finish_reason} input_tokens={result.num_input_tokens} "
            f"output_tokens={num_tokens} TTFT={ttft} tokens/s={rate}",
            file=sys.stderr,
        )
    return 1 if result.error else 0


if __name__ == "__main__":
    sys.exit(main())
