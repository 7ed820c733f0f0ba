"""perf.lora_bench starts vLLM under our engine's limits: the same batch budget and sequence cap
as the engines it is measured beside (without them vLLM's CPU server takes its own defaults)."""

from __future__ import annotations

import json

from backend.config import engine_config_from_model_folder
from backend.paths import REPO_ROOT
from perf import lora_bench
from perf.compare import vllm_server


def test_vllm_gets_our_budget_sequences_and_adapters(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(vllm_server, "start_vllm", lambda *args, **kwargs: calls.append((args, kwargs)) or "server")
    config = engine_config_from_model_folder(str(REPO_ROOT / "model_repository" / "llm"), max_num_batched_tokens="768",
                                             max_num_seqs="24")
    table = tmp_path / "adapters.json"
    table.write_text(json.dumps({"a0": "a0", "a1": "a1"}))
    server, served = lora_bench.start_vllm_with_adapters("/models/x", table, ["a0", "a1"], 8, "bfloat16", config)
    assert (server, served) == ("server", vllm_server.SERVED_MODEL_NAME)
    (args, kwargs), = calls
    assert args == ("/models/x",)
    assert kwargs["max_num_batched_tokens"] == 768
    assert kwargs["max_num_seqs"] == 24
    assert kwargs["max_model_len"] == config.model.max_model_len
    extra = kwargs["extra_args"]
    assert extra[extra.index("--max-loras") + 1] == "2"
    assert extra[extra.index("--lora-modules") + 1:] == [f"a0={tmp_path / 'a0'}", f"a1={tmp_path / 'a1'}"]
