"""The `tokenizer` model through tritonclient: round trips, the LLM's ids, and dynamic batching."""

from __future__ import annotations

import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tokenizers import Tokenizer

from client.stream import StreamingClient

pytestmark = pytest.mark.integration

TEXTS = ["hello world", "Über den Wolken, 東京 — caches & blocks", "", "a" * 300, "line one\nline two\t"]


def encode(client, text: str, **flags):
    inputs = [grpcclient.InferInput("text_input", [1, 1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([[text.encode("utf-8")]], dtype=np.object_))
    for name, value in flags.items():
        tensor = grpcclient.InferInput(name, [1, 1], "BOOL")
        tensor.set_data_from_numpy(np.array([[value]], dtype=bool))
        inputs.append(tensor)
    outputs = [grpcclient.InferRequestedOutput("output_ids"), grpcclient.InferRequestedOutput("num_tokens")]
    return inputs, outputs


def decode(ids: list[int]):
    tensor = grpcclient.InferInput("input_ids", [1, len(ids)], "INT32")
    tensor.set_data_from_numpy(np.array([ids], dtype=np.int32))
    outputs = [grpcclient.InferRequestedOutput("text_output"), grpcclient.InferRequestedOutput("num_tokens")]
    return [tensor], outputs


def infer(client, request):
    inputs, outputs = request
    return client.infer("tokenizer", inputs, outputs=outputs)


def test_round_trip_matches_the_llm_tokenizer(triton_server, demo_model_dir):
    reference = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    for text in TEXTS:
        result = infer(client, encode(client, text))
        ids = result.as_numpy("output_ids").reshape(-1).tolist()
        assert ids == reference.encode(text).ids
        assert ids[0] == 1  # BOS, as the engine tokenizes prompts
        assert int(result.as_numpy("num_tokens").reshape(-1)[0]) == len(ids)
        back = infer(client, decode(ids))
        assert back.as_numpy("text_output").reshape(-1)[0].decode("utf-8") == text
        assert int(back.as_numpy("num_tokens").reshape(-1)[0]) == len(ids)
    plain = infer(client, encode(client, "hello world", add_special_tokens=False))
    assert plain.as_numpy("output_ids").reshape(-1).tolist() == reference.encode("hello world").ids[1:]


def test_token_count_agrees_with_the_llm(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    prompt = "Return the number of items"
    count = int(infer(client, encode(client, prompt)).as_numpy("num_tokens").reshape(-1)[0])
    with StreamingClient(triton_server.grpc_url) as llm:
        result = llm.generate(prompt, max_tokens=1)
    assert result.num_input_tokens == count


@pytest.mark.parametrize("inputs", ["none", "both", "bad_id"])
def test_bad_requests_get_an_error_naming_the_input(triton_server, inputs):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    tensors = []
    if inputs in ("both",):
        tensors += encode(client, "x")[0]
    if inputs in ("both", "bad_id"):
        tensors += decode([1, 10**8] if inputs == "bad_id" else [1, 2])[0]
    if inputs == "none":
        flag = grpcclient.InferInput("add_special_tokens", [1, 1], "BOOL")
        flag.set_data_from_numpy(np.array([[True]], dtype=bool))
        tensors = [flag]
    with pytest.raises(Exception) as info:
        client.infer("tokenizer", tensors)
    assert "input_ids" in str(info.value)
    assert infer(client, encode(client, "still fine")).as_numpy("num_tokens").reshape(-1)[0] > 0


def test_concurrent_requests_are_batched(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    before = client.get_inference_statistics("tokenizer", as_json=True)["model_stats"][0]
    results = []
    import threading

    done = threading.Event()
    count = 256

    def callback(result, error):
        results.append((result, error))
        if len(results) == count:
            done.set()

    for i in range(count):
        inputs, outputs = encode(client, f"request number {i} " * (1 + i % 5))
        client.async_infer("tokenizer", inputs, callback, outputs=outputs)
    assert done.wait(120)
    assert all(error is None for _, error in results)
    # Triton updates its statistics when a request is released, which can trail the response the
    # client already holds: wait (bounded) for the counts to settle before comparing.
    deadline = time.monotonic() + 30
    while True:
        after = client.get_inference_statistics("tokenizer", as_json=True)["model_stats"][0]
        executions = int(after.get("execution_count", 0)) - int(before.get("execution_count", 0))
        inferences = int(after.get("inference_count", 0)) - int(before.get("inference_count", 0))
        if inferences >= count or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert inferences == count
    assert executions < count, (executions, inferences)  # some executions held several requests
    assert max(int(b["batch_size"]) for b in after["batch_stats"]) > 1
