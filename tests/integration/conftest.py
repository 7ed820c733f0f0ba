"""Real tritonserver fixtures: started by our launcher on free ports, always stopped.

``triton_server`` serves the served configuration on the demo model (models/demo-repository, i.e.
model_repository with only the model parameters changed) for the whole session. ``make_server``
starts a server on a copy of it with changed parameters, for tests that need a tiny KV pool, a
short queue and so on.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from backend.models.demo_model import DEMO_REPOSITORY, set_parameters
from backend.server.launcher import start_server

MODEL_REPOSITORY = DEMO_REPOSITORY  # what the session's server serves


def write_model_repository(dest: Path, demo_model_dir: Path, overrides: dict[str, str] | None = None,
                           models: tuple[str, ...] = ("llm",), edits: dict[str, str] | None = None) -> Path:
    """Copies the named models into ``dest`` with absolute model paths and overridden parameters.

    ``edits`` replaces text of each config.pbtxt (old -> new), e.g. the dynamic batcher's delay;
    every old text must be present.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for name in models:
        shutil.copytree(MODEL_REPOSITORY / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        config_path = dest / name / "config.pbtxt"
        text = set_parameters(config_path.read_text(),
                              {"model_dir": str(demo_model_dir), "tokenizer_dir": str(demo_model_dir)})
        text = set_parameters(text, overrides or {}, insert_missing=True)
        for old, new in (edits or {}).items():
            assert old in text, f"{old!r} not in {config_path}"
            text = text.replace(old, new)
        config_path.write_text(text)
    return dest


def stop_and_show_log(server) -> None:
    """Stops ``server`` and prints the end of its log with its exit status: pytest shows a
    teardown's output only when the test failed, and then the log is what says why (the log
    folder goes with the server)."""
    alive = server.process.poll() is None
    tail = server.log_tail(12000)
    code = server.stop()
    print(f"--- tritonserver {'was running' if alive else f'had exited with {code}'}; the end of its log:\n{tail}")


def serve_replicas(cluster):
    """Yields ``cluster`` (backend/server/replicas.py: Replicas) started; always stopped after, and
    on a failure the router's and the replicas' log tails are printed."""
    try:
        cluster.start()
        yield cluster
    except BaseException:
        for index in (None, *range(len(cluster.ports))):
            print(f"--- {cluster.log_path(index)}:\n{cluster.log_tail(index)}")
        raise
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def triton_server(demo_model_dir):
    server = start_server(MODEL_REPOSITORY, ready_timeout=300)
    try:
        yield server
    finally:
        stop_and_show_log(server)


@pytest.fixture()
def make_server(tmp_path, demo_model_dir):
    """Starts servers on custom model repositories; all are stopped after the test."""
    servers = []

    def make(overrides: dict[str, str] | None = None, extra_args: list[str] | None = None,
             models: tuple[str, ...] = ("llm",), wait: bool = True, edits: dict[str, str] | None = None):
        repo = write_model_repository(tmp_path / f"repo{len(servers)}", demo_model_dir, overrides, models, edits)
        server = start_server(repo, extra_args=extra_args, wait=wait, ready_timeout=300)
        servers.append(server)
        return server

    yield make
    for server in servers:
        stop_and_show_log(server)
