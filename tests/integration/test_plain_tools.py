"""perf_analyzer and genai-perf typed as a user types them after `make setup`: no PATH, no LD_LIBRARY_PATH.

`make setup` gives perf_analyzer a RUNPATH to the CUDA runtime wheel and the venv a .pth that puts
its bin on PATH (perf/perf_analyzer_env.py), so nothing has to be exported first.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backend.models.demo_model import DEFAULT_OUT as DEMO_MODEL

pytestmark = pytest.mark.integration

VENV_BIN = Path(sys.executable).parent
BARE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def libb64_missing() -> bool:
    """Debian's libb64 (apt, root only): the one piece setup cannot install everywhere."""
    if shutil.which("dpkg") is None:
        return False
    return subprocess.run(["dpkg", "-s", "libb64-0d"], capture_output=True).returncode != 0


needs_libb64 = pytest.mark.skipif(libb64_missing(), reason="libb64-0d is not installed (apt-get, as root)")


@needs_libb64
def test_perf_analyzer_starts_with_an_empty_environment():
    done = subprocess.run([str(VENV_BIN / "perf_analyzer"), "--version"], env=BARE_ENV, capture_output=True,
                          text=True, timeout=60)
    assert "Perf Analyzer" in done.stdout + done.stderr, done.stdout + done.stderr


@needs_libb64
def test_genai_perf_profile_runs_as_typed(triton_server, tmp_path):
    command = [
        str(VENV_BIN / "genai-perf"), "profile", "-m", "llm", "--service-kind", "triton", "--backend", "tensorrtllm",
        "--streaming", "-u", triton_server.grpc_url, "--tokenizer", str(DEMO_MODEL), "--concurrency", "1",
        "--num-prompts", "4", "--synthetic-input-tokens-mean", "16", "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", "4", "--artifact-dir", str(tmp_path / "artifacts"),
        "--", "--measurement-mode", "count_windows", "--measurement-request-count", "4", "-s", "999", "-r", "3",
    ]
    for attempt in range(2):
        done = subprocess.run(command, env={**BARE_ENV, "HOME": str(tmp_path)}, cwd=tmp_path, capture_output=True,
                              text=True, timeout=600)
        output = done.stdout + done.stderr
        # perf_analyzer now and then leaves an empty profile export here (exit 0; seen in CI, cause
        # unknown, as perf/run_perf_analyzer.py says); genai-perf then fails parsing it: once, run again.
        if done.returncode == 0 or attempt or "Failed to parse JSON string: ''" not in output:
            break
        print("genai-perf: perf_analyzer left an empty profile export; running it once more")
        shutil.rmtree(tmp_path / "artifacts", ignore_errors=True)
    assert done.returncode == 0, output[-3000:]
    (report,) = (tmp_path / "artifacts").rglob("profile_export_genai_perf.json")
    assert json.loads(report.read_text())["request_throughput"]["avg"] > 0
