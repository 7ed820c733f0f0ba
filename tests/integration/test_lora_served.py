"""LoRA adapters through a real tritonserver and the OpenAI front (issue 34).

The demo model with four peft adapters (tests/lora_adapters.py) served as `make serve` runs it
(the launcher: tritonserver and the OpenAI front). Checked: the front lists the adapters as models
and a request naming one gets the adapter's greedy tokens (the engine's own, which the unit tests
hold equal to peft's); the gRPC path takes vllm_backend's ``lora_name`` and TensorRT-LLM's
``lora_task_id``; an unknown adapter is refused naming it while the others are served; the
per-adapter counter and vLLM's ``vllm:lora_requests_info`` are on Triton's metrics endpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend.config import engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.protocol.sampling import SamplingParams
from backend.server.launcher import free_port
from tests.integration.conftest import write_model_repository
from tests.lora_adapters import ADAPTERS, make_adapters

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "lantern orchard violet copper meadow harbor thunder pepper velvet candle signal marble"
MAX_TOKENS = 8


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


@pytest.fixture(scope="module")
def served(demo_model_dir, tmp_path_factory):
    table = make_adapters(str(demo_model_dir), tmp_path_factory.mktemp("loras"))
    overrides = {"enable_lora": "true", "lora_adapters": str(table), "max_loras": "2"}
    repo = tmp_path_factory.mktemp("repo")
    write_model_repository(repo, demo_model_dir, overrides, ("llm",))
    write_model_repository(repo, demo_model_dir, None, ("tokenizer",))
    http, grpc, metrics, openai_port = (free_port() for _ in range(4))
    launcher = subprocess.Popen([sys.executable, "-m", "backend.server.launcher", "--model-repository", str(repo),
                                 "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                                 "--openai-port", str(openai_port)], stdout=subprocess.DEVNULL, start_new_session=True)
    front = f"http://127.0.0.1:{openai_port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert launcher.poll() is None and time.monotonic() < deadline, "the launcher did not come up"
            try:
                with urllib.request.urlopen(f"{front}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        yield {"front": front, "grpc": f"127.0.0.1:{grpc}", "metrics": f"http://127.0.0.1:{metrics}/metrics",
               "folder": str(repo / "llm")}
    finally:
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def expected(served) -> dict[str | None, str]:
    """The engine's greedy text of PROMPT under each adapter (and the base model), in-process."""
    engine = LLMEngine(engine_config_from_model_folder(served["folder"]))
    names = [None, *ADAPTERS]
    results = engine.generate([PROMPT] * len(names),
                              [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, lora_name=n) for n in names])
    engine.close()
    texts = {name: result.text for name, result in zip(names, results, strict=True)}
    assert len(set(texts.values())) == len(names)  # every adapter changes the text
    return texts


def test_the_front_lists_the_adapters_and_serves_each_by_model_name(served, expected):
    with urllib.request.urlopen(f"{served['front']}/v1/models", timeout=30) as response:
        models = json.load(response)["data"]
    assert [m["id"] for m in models] == ["llm", *ADAPTERS]
    assert all(m["parent"] == "llm" for m in models[1:])
    for name in (None, *ADAPTERS):
        status, body = post(f"{served['front']}/v1/completions", {"model": name or "llm", "prompt": PROMPT,
                                                                  "max_tokens": MAX_TOKENS, "ignore_eos": True})
        assert status == 200 and body["choices"][0]["text"] == expected[name], (name, body)
    status, body = post(f"{served['front']}/v1/completions", {"model": "../qv8", "prompt": PROMPT})
    assert status in (400, 404) and body["error"]["param"] == "model" and body["error"]["code"] == "model_not_found"


def infer(grpc_url: str, **inputs) -> tuple[str | None, str | None]:
    """(text, error) of one streamed gRPC request with these extra inputs."""
    client = grpcclient.InferenceServerClient(grpc_url)
    tensors = []
    for name, value in {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, **inputs}.items():
        array = (np.array([[value.encode()]], dtype=np.object_) if isinstance(value, str) else
                 np.array([[value]], dtype=np.bool_ if isinstance(value, bool) else
                          np.uint64 if name == "lora_task_id" else np.int32))
        tensor = grpcclient.InferInput(name, list(array.shape), {np.object_: "BYTES", np.bool_: "BOOL",
                                                                  np.uint64: "UINT64", np.int32: "INT32"}[array.dtype.type])
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    client.async_stream_infer("llm", tensors, enable_empty_final_response=True)
    deadline = time.monotonic() + 60
    while not results or (results[-1][1] is None and not results[-1][0].get_response().parameters[
            "triton_final_response"].bool_param):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.stop_stream()
    errors = [str(e) for _, e in results if e is not None]
    if errors:
        return None, errors[0]
    text = "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r, _ in results
                   if r.as_numpy("text_output") is not None)
    return text, None


def test_grpc_takes_lora_name_and_task_id_and_refuses_unknown_adapters(served, expected):
    assert infer(served["grpc"], sampling_parameters=json.dumps({"lora_name": "mlp8rs"})) == (expected["mlp8rs"], None)
    assert infer(served["grpc"], lora_task_id=44) == (expected["ok4"], None)
    text, error = infer(served["grpc"], sampling_parameters=json.dumps({"lora_name": "nope"}))
    assert text is None and "lora_name: 'nope' is not an adapter of this model" in error
    text, error = infer(served["grpc"], lora_task_id=9)
    assert text is None and "lora_task_id: 9 is not an adapter of this model" in error
    assert infer(served["grpc"])[0] == expected[None]  # and the base model goes on


def test_adapter_metrics_are_on_tritons_endpoint(served):
    post(f"{served['front']}/v1/completions", {"model": "qv8", "prompt": PROMPT, "max_tokens": 2})
    time.sleep(1.0)
    text = urllib.request.urlopen(served["metrics"], timeout=10).read().decode()
    assert 'llm_lora_requests_total{lora_name="qv8",model="llm"}' in text or \
        'llm_lora_requests_total{model="llm",lora_name="qv8"}' in text
    assert "vllm:lora_requests_info{" in text and 'max_lora="2"' in text
    assert "llm_lora_loaded_adapters" in text
