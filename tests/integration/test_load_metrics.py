"""The load metrics cluster schedulers read (vLLM's and TensorRT-LLM's names) on Triton's endpoint."""

from __future__ import annotations

import re
import threading
import time

import pytest

from client.stream import StreamingClient
from tests.integration.test_llm_model import read_metrics

pytestmark = pytest.mark.integration


def scrape(server) -> dict[str, float]:
    """Every vllm:* and nv_trt_llm_* series, and ours."""
    return read_metrics(server, ("vllm:", "nv_trt_llm_", "llm_"))


def value(values: dict[str, float], name: str, **labels) -> float:
    for key, number in values.items():
        match = re.fullmatch(r"([a-zA-Z0-9_:]+)\{(.*)\}", key)
        if match and match.group(1) == name:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            if all(found.get(k) == v for k, v in labels.items()):
                return number
    raise KeyError(f"{name}{labels} not in the metrics")


def test_vllm_and_tensorrt_llm_load_metrics_follow_the_engine(triton_server):
    with StreamingClient(triton_server.grpc_url) as client:  # the first stats arrive with a step
        assert client.generate("warm up", timeout=60, max_tokens=2).error is None
    idle = scrape(triton_server)
    assert value(idle, "vllm:cache_config_info", model_name="llm", block_size="16", num_gpu_blocks="2048") == 1
    assert value(idle, "nv_trt_llm_request_metrics", model="llm", request_type="max") == 64
    assert value(idle, "nv_trt_llm_kv_cache_block_metrics", model="llm", kv_cache_block_type="tokens_per") == 16
    assert value(idle, "nv_trt_llm_kv_cache_block_metrics", model="llm", kv_cache_block_type="max") == 2047
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        assert value(idle, name, model_name="llm") == 0

    done = threading.Event()

    def one_stream(i: int) -> None:
        with StreamingClient(triton_server.grpc_url) as client:
            client.generate(f"long {i}", timeout=120, max_tokens=600, ignore_eos=True, stream=True)

    def long_streams():
        threads = [threading.Thread(target=one_stream, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        done.set()

    threading.Thread(target=long_streams, daemon=True).start()
    deadline = time.monotonic() + 30
    busy = None
    while time.monotonic() < deadline:
        values = scrape(triton_server)
        if value(values, "vllm:num_requests_running", model_name="llm") == 3:
            busy = values
            break
        time.sleep(0.05)
    assert busy is not None, "the three streams never showed as running"
    assert value(busy, "nv_trt_llm_request_metrics", model="llm", request_type="scheduled") == 3
    assert value(busy, "nv_trt_llm_request_metrics", model="llm", request_type="active") >= 3
    usage = value(busy, "vllm:kv_cache_usage_perc", model_name="llm")
    assert 0 < usage < 1 and usage == value(busy, "llm_kv_cache_usage_ratio", model="llm")
    assert usage == value(busy, "nv_trt_llm_kv_cache_block_metrics", model="llm", kv_cache_block_type="fraction")
    used = value(busy, "nv_trt_llm_kv_cache_block_metrics", model="llm", kv_cache_block_type="used")
    free = value(busy, "nv_trt_llm_kv_cache_block_metrics", model="llm", kv_cache_block_type="free")
    assert used > 0 and used + free == 2047
    assert done.wait(120)
