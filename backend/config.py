"""Engine configuration: frozen dataclasses and parsing from config.pbtxt string parameters.

config.pbtxt is the single source of configuration. Its `parameters` map arrives as
``{name: string_value}``; :func:`parse_engine_config` turns it into an :class:`EngineConfig`,
rejecting unknown names and bad values with a message that names the parameter.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import get_type_hints


class ConfigError(ValueError):
    """A configuration parameter is unknown or has a bad value; the message names it."""


# Parameters of an LLM model's config.pbtxt that the serving glue reads (backend/triton), not the
# engine: offline tools building the engine from a model folder skip them.
GLUE_PARAMETER_NAMES = frozenset({
    "shutdown_grace_seconds", "triton_http_url", "engine_process", "engine_heartbeat_timeout_seconds",
    "on_stub_death", "stream_interval", "response_coalescing",
    "client_priority_range", "client_priority_clamp",
    "reasoning_parser",  # the OpenAI front's (openai_front/reasoning.py), read over gRPC
})

# No tokenizer we know packs more than this many UTF-8 bytes into an average token of real text.
PROMPT_BYTES_PER_TOKEN = 32


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_dir: str
    tokenizer_dir: str  # defaults to model_dir
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto | torch | cupy | cpu
    cpu_fused_ops: bool = True  # with the CPU kernels: fused RMSNorm, SiLU x up and rotary + cache write
    cpu_adaptive_threads: bool = True  # fewer torch threads while other processes hold the CPUs (engine/cpu_threads.py)
    max_model_len: int = 2048  # prompt + output tokens of one request
    seed: int = 0
    max_prompt_bytes: int = 0  # UTF-8 bytes of one prompt; 0: PROMPT_BYTES_PER_TOKEN x max_model_len
    tensor_parallel_size: int = 1  # ranks the model is split across (backend/parallel)

    @property
    def prompt_byte_limit(self) -> int:
        """Longer prompts are refused before tokenizing: they could not fit max_model_len anyway."""
        return self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * self.max_model_len


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: size from kv_cache_memory_mb, or automatically
    kv_cache_memory_mb: int = 0  # 0: automatic
    enable_prefix_caching: bool = True
    # The second KV tier (backend/kv_cache/offload): evicted prefix blocks spill there and return.
    kv_offload_tier: str = "none"  # none | host | disk
    kv_offload_bytes: int = 0  # capacity; 0: 1 GiB
    kv_offload_dir: str = ""  # the disk tier's folder; empty: ~/.cache/triton-llm/kv_offload
    kv_offload_load_policy: str = "auto"  # auto: the cost rule decides load or recompute; always: load
    kv_offload_queue_blocks: int = 256  # blocks waiting to be written; more are dropped


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority (lower sampling_params.priority first, as vLLM)
    max_queue_len: int = 1024  # waiting requests beyond this are rejected as busy
    max_requests_per_client: int = 0  # one client's (user's) requests in flight or waiting; 0: no cap
    default_max_tokens: int = 128


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (backend/spec_decode): proposals verified in the step's one forward."""

    speculative_method: str = "none"  # none | ngram (prompt lookup) | draft (a small model, same vocabulary)
    num_speculative_tokens: int = 3  # the most tokens proposed per request and step
    prompt_lookup_min: int = 2  # ngram: the shortest suffix matched against the request's tokens
    prompt_lookup_max: int = 5  # ngram: the longest
    speculative_model_dir: str = ""  # draft: the draft checkpoint folder
    speculative_num_kv_blocks: int = 0  # draft: its own KV pool in blocks; 0: as many as the target's
    speculative_controller: str = "auto"  # auto: speculate only where the cost model predicts a gain; off: always

    @property
    def enabled(self) -> bool:
        return self.speculative_method != "none"


@dataclass(frozen=True, slots=True)
class StructuredOutputConfig:
    """Bounds on what a client's constraint may cost (backend/structured_output): a budget checked
    before compiling, a compile timeout and compiles in flight per client."""

    structured_output_max_schema_bytes: int = 32 * 1024  # UTF-8 bytes of one schema, regex or grammar
    structured_output_max_depth: int = 32  # nesting of objects and arrays in a JSON schema
    structured_output_max_properties: int = 256  # properties over a whole schema
    structured_output_max_patterns: int = 32  # regex patterns (pattern, patternProperties) in a schema
    structured_output_max_pattern_length: int = 1024  # characters of one pattern or regex
    structured_output_compile_timeout_seconds: int = 10  # a compile running longer fails its requests
    structured_output_max_compiles_per_client: int = 2  # compiles in flight for one client (user); 0: no cap


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """KV-cache events for a cache-aware router (backend/kv_cache/event_publisher.py): vLLM's ZMQ wire."""

    kv_events_endpoint: str = ""  # tcp://HOST:PORT the PUB socket binds; empty: no events
    kv_events_topic: str = ""  # the first frame of every message
    kv_events_replay_endpoint: str = ""  # tcp://HOST:PORT of the replay ROUTER socket; empty: no replay
    kv_events_buffer_steps: int = 10_000  # batches kept for replay

    @property
    def enabled(self) -> bool:
        return bool(self.kv_events_endpoint)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """LoRA adapters (backend/lora): which ones (``lora_adapters``, vllm_backend's multi_lora.json)
    and how many per step and in memory."""

    enable_lora: bool = False
    max_loras: int = 4  # distinct adapters in the running batch
    max_lora_rank: int = 16  # adapters of a higher rank are refused
    max_cpu_loras: int = 8  # adapters kept loaded (least recently used out; those in use never)
    lora_adapters: str = ""  # name -> PEFT folder JSON; empty: 1/multi_lora.json in the model's folder


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (backend/kv_transfer): a prefill engine serves a finished prompt's
    KV blocks, a decode engine pulls them from the peers listed here."""

    kv_role: str = "both"  # both: no transfers (colocated); prefill: serves blocks; decode: pulls them
    kv_transfer_endpoint: str = ""  # prefill: tcp://HOST:PORT it serves blocks on; empty: loopback, any free port
    kv_transfer_peers: str = ""  # decode: comma-separated HOST:PORT of the prefill engines it may pull from
    kv_transfer_timeout_seconds: int = 60  # prefill: how long a finished request's blocks wait to be pulled
    kv_transfer_pull_timeout_seconds: int = 10  # decode: a pull not done by then is recomputed locally

    @property
    def peers(self) -> frozenset[tuple[str, int]]:
        """``kv_transfer_peers`` as (host, port) pairs (checked by validate_engine_config)."""
        return frozenset(_host_port(item) for item in self.kv_transfer_peers.split(",") if item.strip())


def _host_port(text: str) -> tuple[str, int]:
    match = _HOST_PORT.fullmatch(text.strip())
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(f"parameter 'kv_transfer_peers': expected HOST:PORT entries separated by commas, "
                          f"got {text.strip()!r}")
    return match.group(1).strip("[]"), int(match.group(2))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)


_CHOICES = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "device": ("auto", "cpu", "cuda"),
    "attention_backend": ("auto", "torch", "cupy", "cpu"),
    "scheduling_policy": ("fcfs", "priority"),
    "kv_offload_tier": ("none", "host", "disk"),
    "kv_offload_load_policy": ("auto", "always"),
    "speculative_method": ("none", "ngram", "draft"),
    "speculative_controller": ("auto", "off"),
    "kv_role": ("both", "prefill", "decode"),
}

# The kind of each str parameter that is neither a choice (_CHOICES) nor free text.
_STRING_KINDS = {
    **dict.fromkeys(("model_dir", "tokenizer_dir", "kv_offload_dir", "speculative_model_dir", "lora_adapters"), "path"),
    **dict.fromkeys(("kv_events_endpoint", "kv_events_replay_endpoint", "kv_transfer_endpoint"), "endpoint"),
}
# The int parameters that may be 0 (automatic, no cap, the first seed); every other one is at least 1.
_ZERO_ALLOWED = frozenset({
    "seed", "max_prompt_bytes", "num_kv_blocks", "kv_cache_memory_mb", "kv_offload_bytes", "max_queue_len",
    "max_requests_per_client", "speculative_num_kv_blocks", "structured_output_max_patterns",
    "structured_output_max_compiles_per_client",
})
# EngineConfig's field name -> the dataclass of that section.
_SECTIONS: dict[str, type] = get_type_hints(EngineConfig)


def _parameter_table() -> dict[str, tuple[str, str, int | None]]:
    """name -> (section, kind, minimum) of every parameter. Each field of a section is one, so a
    new field is a new parameter; its type gives the kind (for a str: choice, path, endpoint or text)."""
    table = {}
    for section, section_class in _SECTIONS.items():
        for name, annotation in get_type_hints(section_class).items():
            if annotation is int:
                table[name] = (section, "int", 0 if name in _ZERO_ALLOWED else 1)
            elif annotation is bool:
                table[name] = (section, "bool", None)
            else:
                table[name] = (section, "choice" if name in _CHOICES else _STRING_KINDS.get(name, "text"), None)
    return table


_PARAMETERS = _parameter_table()

# tcp://HOST:PORT with a name, an IPv4 address, [an IPv6 address] or * (every interface).
_ENDPOINT = re.compile(r"tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})")
_HOST_PORT = re.compile(r"([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})")
MAX_TEXT_PARAMETER_CHARS = 256


def parse_parameter_value(name: str, kind: str, minimum: int | None, raw: str, base_dir: str | None = None):
    """One config.pbtxt value of ``kind`` (int, bool, choice, path); ConfigError naming ``name``."""
    text = str(raw).strip()
    if kind == "int":
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"parameter '{name}': expected an integer, got {raw!r}") from None
        if minimum is not None and value < minimum:
            raise ConfigError(f"parameter '{name}': must be >= {minimum}, got {value}")
        return value
    if kind == "bool":
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"parameter '{name}': expected true or false, got {raw!r}")
    if kind == "choice":
        if text not in _CHOICES[name]:
            raise ConfigError(f"parameter '{name}': expected one of {', '.join(_CHOICES[name])}, got {raw!r}")
        return text
    if kind == "endpoint":
        match = _ENDPOINT.fullmatch(text)
        if text and (match is None or not 0 < int(match.group(2)) < 65536):
            raise ConfigError(f"parameter '{name}': expected tcp://HOST:PORT with a port in 1-65535 "
                              f"(or empty), got {raw!r}")
        return text
    if kind == "text":
        if len(text) > MAX_TEXT_PARAMETER_CHARS * (16 if name == "kv_transfer_peers" else 1):
            raise ConfigError(f"parameter '{name}': at most {MAX_TEXT_PARAMETER_CHARS} characters")
        return text
    if kind == "path":
        if not text and name in ("kv_offload_dir", "speculative_model_dir", "lora_adapters"):
            return ""  # the default folder; no draft model
        if not text:
            raise ConfigError(f"parameter '{name}': must not be empty")
        if base_dir is not None and not os.path.isabs(text):
            text = os.path.normpath(os.path.join(base_dir, text))
        return text
    raise AssertionError(kind)


def parse_engine_config(
    parameters: dict[str, str], base_dir: str | None = None, extra_names: frozenset[str] = frozenset()
) -> EngineConfig:
    """Builds an EngineConfig from string parameters (config.pbtxt's `parameters`).

    Relative paths resolve against ``base_dir`` (the model's folder). Names in ``extra_names`` are
    accepted and ignored (they belong to the caller). Raises ConfigError naming the parameter.
    """
    sections: dict[str, dict] = {section: {} for section in _SECTIONS}
    for name, raw in parameters.items():
        if name in extra_names:
            continue
        if name not in _PARAMETERS:
            known = ", ".join(sorted(_PARAMETERS | dict.fromkeys(extra_names)))
            raise ConfigError(f"unknown parameter '{name}' (known: {known})")
        section, kind, minimum = _PARAMETERS[name]
        sections[section][name] = parse_parameter_value(name, kind, minimum, raw, base_dir)
    model = sections["model"]
    if "model_dir" not in model:
        raise ConfigError("parameter 'model_dir': required")
    lora = sections["lora"]
    if not lora.get("lora_adapters") and base_dir is not None:  # vllm_backend's place for it
        lora["lora_adapters"] = os.path.join(base_dir, "1", "multi_lora.json")
    model.setdefault("tokenizer_dir", model["model_dir"])
    config = EngineConfig(**{section: _SECTIONS[section](**values) for section, values in sections.items()})
    validate_engine_config(config)
    return config


def validate_engine_config(config: EngineConfig) -> None:
    """Cross-field checks; raises ConfigError naming the parameter."""
    cache, sched, model = config.cache, config.scheduler, config.model
    if cache.num_kv_blocks and cache.kv_cache_memory_mb:
        raise ConfigError("parameters 'num_kv_blocks' and 'kv_cache_memory_mb': set at most one of them")
    if cache.kv_offload_tier != "none" and not cache.enable_prefix_caching:
        raise ConfigError("parameter 'kv_offload_tier': needs enable_prefix_caching true (the tier keeps "
                          "evicted prefix-cache blocks)")
    if cache.num_kv_blocks == 1:
        raise ConfigError("parameter 'num_kv_blocks': needs at least 2 (one is the null block)")
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < model.max_model_len:
        raise ConfigError(
            "parameter 'max_num_batched_tokens': must be >= max_model_len "
            f"({model.max_model_len}) when enable_chunked_prefill is false"
        )
    _validate_speculative(config.speculative)
    _validate_tensor_parallel(config)
    _validate_kv_events(config.kv_events, cache)
    _validate_kv_transfer(config.kv_transfer, cache)
    _validate_lora(config)
    if sched.default_max_tokens >= model.max_model_len:
        raise ConfigError(
            f"parameter 'default_max_tokens': must be < max_model_len ({model.max_model_len})"
        )


def _validate_tensor_parallel(config: EngineConfig) -> None:
    """What a tensor-parallel group does not run yet: each of these reads or writes the KV cache of
    rank 0 alone."""
    size = config.model.tensor_parallel_size
    if size == 1:
        return
    refused = [("kv_offload_tier", config.cache.kv_offload_tier != "none"),
               ("kv_role", config.kv_transfer.kv_role != "both")]
    for name, set_here in refused:
        if set_here:
            raise ConfigError(f"parameter '{name}': not with tensor_parallel_size {size} (its KV transfers "
                              "would reach rank 0's share of the cache only)")


MAX_SPECULATIVE_TOKENS = 16


def _validate_kv_events(events: KVEventsConfig, cache: CacheConfig) -> None:
    if events.kv_events_replay_endpoint and not events.kv_events_endpoint:
        raise ConfigError("parameter 'kv_events_replay_endpoint': needs kv_events_endpoint (replay resends "
                          "what that socket published)")
    if events.enabled and events.kv_events_replay_endpoint == events.kv_events_endpoint:
        raise ConfigError("parameter 'kv_events_replay_endpoint': must differ from kv_events_endpoint")
    if events.enabled and not cache.enable_prefix_caching:
        raise ConfigError("parameter 'kv_events_endpoint': needs enable_prefix_caching true (the events "
                          "describe the prefix cache)")


def _validate_kv_transfer(transfer: KVTransferConfig, cache: CacheConfig) -> None:
    peers = transfer.peers  # raises naming kv_transfer_peers when an entry is not HOST:PORT
    if transfer.kv_role == "decode" and not peers:
        raise ConfigError("parameter 'kv_transfer_peers': kv_role decode needs the prefill engines it may pull "
                          "from (HOST:PORT, comma-separated)")
    if transfer.kv_role != "decode" and peers:
        raise ConfigError(f"parameter 'kv_transfer_peers': only a decode engine pulls (kv_role is {transfer.kv_role})")
    if transfer.kv_role != "prefill" and transfer.kv_transfer_endpoint:
        raise ConfigError(f"parameter 'kv_transfer_endpoint': only a prefill engine serves blocks "
                          f"(kv_role is {transfer.kv_role})")
    if transfer.kv_role != "both" and not cache.enable_prefix_caching:
        raise ConfigError(f"parameter 'kv_role': {transfer.kv_role} needs enable_prefix_caching true (blocks "
                          "are matched by their chained hashes)")


MAX_LORA_RANK = 256


def _validate_lora(config: EngineConfig) -> None:
    lora = config.lora
    if lora.max_lora_rank > MAX_LORA_RANK:
        raise ConfigError(f"parameter 'max_lora_rank': at most {MAX_LORA_RANK}, got {lora.max_lora_rank}")
    if lora.max_cpu_loras < lora.max_loras:
        raise ConfigError(f"parameter 'max_cpu_loras': must be >= max_loras ({lora.max_loras}): the adapters of a "
                          f"step are all loaded, got {lora.max_cpu_loras}")
    if lora.enable_lora and config.speculative.speculative_method == "draft":
        raise ConfigError("parameter 'enable_lora': not with speculative_method draft (the draft model has no "
                          "adapters, so its proposals would follow the base model; ngram works with adapters)")


def _validate_speculative(spec: SpeculativeConfig) -> None:
    if spec.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"parameter 'num_speculative_tokens': at most {MAX_SPECULATIVE_TOKENS}, "
                          f"got {spec.num_speculative_tokens}")
    if spec.prompt_lookup_min > spec.prompt_lookup_max:
        raise ConfigError(f"parameter 'prompt_lookup_min': must be <= prompt_lookup_max ({spec.prompt_lookup_max}), "
                          f"got {spec.prompt_lookup_min}")
    if spec.speculative_method == "draft" and not spec.speculative_model_dir:
        raise ConfigError("parameter 'speculative_model_dir': required with speculative_method draft")
    if spec.speculative_method != "draft" and spec.speculative_model_dir:
        raise ConfigError("parameter 'speculative_model_dir': only used with speculative_method draft "
                          f"(speculative_method is {spec.speculative_method})")


_PBTXT_PARAMETER = re.compile(r'key\s*:\s*"([^"]+)"\s*value\s*:\s*\{\s*string_value\s*:\s*"((?:[^"\\]|\\.)*)"\s*\}')


def parameters_from_pbtxt(text: str) -> dict[str, str]:
    """The `parameters` entries of a config.pbtxt (``{ key: "k" value: { string_value: "v" } }``).

    Enough protobuf text format for our own files, so offline tools and tests can build the very
    engine a server would, without Triton.
    """
    return {key: value for key, value in _PBTXT_PARAMETER.findall(text)}


def engine_config_from_model_folder(model_folder: str, **overrides: str) -> EngineConfig:
    """The EngineConfig a server would build from ``model_folder/config.pbtxt`` (plus overrides)."""
    with open(os.path.join(model_folder, "config.pbtxt"), encoding="utf-8") as handle:
        parameters = parameters_from_pbtxt(handle.read())
    parameters.update(overrides)
    return parse_engine_config(parameters, base_dir=os.path.abspath(model_folder), extra_names=GLUE_PARAMETER_NAMES)
