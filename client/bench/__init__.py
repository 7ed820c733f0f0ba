"""Token-level load generator for the `llm` model over tritonclient gRPC streaming.

``python -m client.bench --help`` runs it. Parts, one idea each: ``stats`` (pure metrics from
per-request records), ``arrivals`` (when requests are sent), ``lengths`` and ``prompts`` and
``workload`` (what is sent), ``runner`` (sending and timing), ``progress``, ``metadata`` and
``report`` (JSON, markdown, plots).
"""
