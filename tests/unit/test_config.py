"""config.pbtxt parameters: parsed into frozen dataclasses; unknown names and bad values name themselves."""

from __future__ import annotations

import pytest

from backend.config import ConfigError, parse_engine_config


def test_parses_values_and_resolves_relative_paths(tmp_path):
    config = parse_engine_config(
        {"model_dir": "../m", "block_size": "32", "enable_prefix_caching": "false", "dtype": "bfloat16"},
        base_dir=str(tmp_path / "llm"),
    )
    assert config.model.model_dir == str(tmp_path / "m")
    assert config.model.tokenizer_dir == config.model.model_dir
    assert config.cache.block_size == 32
    assert config.cache.enable_prefix_caching is False
    assert config.model.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("parameters", "name"),
    [
        ({"model_dir": "m", "blok_size": "16"}, "blok_size"),
        ({"model_dir": "m", "block_size": "sixteen"}, "block_size"),
        ({"model_dir": "m", "block_size": "0"}, "block_size"),
        ({"model_dir": "m", "dtype": "float64"}, "dtype"),
        ({"model_dir": "m", "enable_chunked_prefill": "maybe"}, "enable_chunked_prefill"),
        ({"block_size": "16"}, "model_dir"),
        ({"model_dir": "m", "num_kv_blocks": "10", "kv_cache_memory_mb": "10"}, "num_kv_blocks"),
        ({"model_dir": "m", "enable_chunked_prefill": "false", "max_num_batched_tokens": "64"}, "max_num_batched_tokens"),
    ],
)
def test_bad_parameters_fail_naming_the_parameter(parameters, name):
    with pytest.raises(ConfigError) as info:
        parse_engine_config(parameters)
    assert f"'{name}'" in str(info.value)
