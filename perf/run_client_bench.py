"""``python -m client.bench`` against a server this script starts (or --url), stopped afterwards.

    python -m perf.run_client_bench [--model-repository DIR | --url HOST:PORT] -- <client.bench args>

Everything after ``--`` goes to client.bench unchanged (--url is filled in); without --out-json the
reports go to perf/results/client_bench/<UTC time>/bench.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import sys

from client.bench.cli import main as bench_main
from perf.served import RESULTS_DIR, add_server_arguments, served


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m perf.run_client_bench", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    args, bench_args = parser.parse_args(argv[:split]), argv[split + 1:]
    if "--out-json" not in bench_args:
        out = RESULTS_DIR / "client_bench" / datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        bench_args += ["--out-json", str(out / "bench.json"), "--out-md", str(out / "bench.md"),
                       "--out-plot", str(out / "bench.png")]
    with served(args) as server:
        return bench_main([*bench_args, "--url", server.grpc_url])


if __name__ == "__main__":
    sys.exit(main())
