"""When a streamed request is sent the tokens that wait for it: ``stream_interval`` (SGLang's
``--stream-interval``, TensorRT-LLM's stream interval).

The first token goes at once (time to first token is not traded away), the last with the FINAL
flag; in between a response waits until at least ``stream_interval`` new tokens are there. A larger
value means fewer, larger responses: less CPU per token on the served path, and a client that sees
tokens in bursts (its inter-token gaps become 0 inside a burst and about ``stream_interval`` steps
between bursts).
"""


def streams_now(num_new_tokens: int, num_tokens_sent: int, stream_interval: int) -> bool:
    """Whether a streamed, unfinished request (or one sample of it) is sent its waiting tokens now."""
    return num_new_tokens > 0 and (num_tokens_sent == 0 or num_new_tokens >= stream_interval)
