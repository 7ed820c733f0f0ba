"""Tensor parallelism served by a real tritonserver: the `llm` model at tensor_parallel_size 2 on
the demo model streams, over gRPC and concurrently, the same greedy ids as the engine in-process at
size 1; its worker runs in the server's process group and is gone once the server stops.
"""

from __future__ import annotations

import pytest

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams
from tests.conftest import DEMO_REPOSITORY
from tests.integration.test_engine_process import mixed_jobs, pids_running, streamed, wait_for
from tests.integration.test_reliability import run_streams
from tests.unit.test_engine_core_process import process_alive

pytestmark = pytest.mark.integration

WORKER_MODULE = b"backend.runner.tp_worker"


def test_size_2_streams_the_ids_of_size_1_and_its_worker_ends_with_the_server(make_server):
    jobs = mixed_jobs(12, seed=36)
    engine = LLMEngine(engine_config_from_model_folder(str(DEMO_REPOSITORY / "llm")))
    expected = engine.generate([p for p, _ in jobs], [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in jobs])
    engine.close()
    server = make_server({"tensor_parallel_size": "2"})
    (worker,) = wait_for(lambda: pids_running(server, WORKER_MODULE), 30, "the tensor-parallel worker")
    results = run_streams(server.grpc_url, streamed(jobs), timeout=120)
    for (prompt, _), result, want in zip(jobs, results, expected, strict=True):
        assert not isinstance(result, Exception), result
        assert result.error is None and result.num_final == 1, (prompt, result.error)
        assert result.token_ids == want.output_token_ids, prompt
    server.stop()
    wait_for(lambda: not pids_running(server, WORKER_MODULE) and not process_alive(worker), 30,
             "the worker to end with the server")

