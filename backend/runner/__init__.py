"""The runner: one forward and one sample for whatever holds a batch, below the features that need it.

- model_runner.py: the model and its paged KV cache, one scheduled step at a time;
- sampler.py: logits to tokens (greedy, seeded, penalties, logprobs);
- row_argmax.py: the greedy pick both the sampler and speculation verify with;
- request_view.py: what the runner and the sampler read of a request (a Protocol), so the engine's
  scheduler, a draft model's shadow sequences and the start-up timer all feed it;
- tp_worker.py: the process of tensor-parallel ranks 1..N-1 (``python -m backend.runner.tp_worker``),
  a ModelRunner fed by rank 0's driver (backend/parallel/driver.py).

The engine (backend/engine) and speculation (backend/spec_decode) import it; it imports no engine
module (import-linter's layers contract in pyproject.toml).
"""
