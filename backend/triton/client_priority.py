"""Which request priorities a client may claim: config.pbtxt ``client_priority_range``.

Lower runs first under ``scheduling_policy: priority`` (vLLM's convention), so a client that may
send any 32-bit priority can jump every queue. ``client_priority_range: "LOW:HIGH"`` (inclusive;
``"0"`` alone means ``"0:0"``) bounds what a request may ask for; the default admits only the
default priority 0. A priority outside the range is refused naming the range, or moved to its
nearest end with ``client_priority_clamp: true``. The shipped `llm` admits ``0:1``, so the offline
batch runner (client/batch, priority 1 by default) can still yield to interactive traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.config import ConfigError
from backend.protocol.sampling import SamplingParams
from backend.triton.inputs import InputError

PRIORITY_LIMIT = 2**31  # priorities are 32-bit integers


@dataclass(frozen=True, slots=True)
class ClientPriorityRange:
    low: int = 0
    high: int = 0
    clamp: bool = False

    def apply(self, params: SamplingParams) -> None:
        """Refuses (InputError naming the range) or clamps ``params.priority``."""
        priority = params.priority
        if self.low <= priority <= self.high:
            return
        if self.clamp:
            params.priority = min(max(priority, self.low), self.high)
            return
        raise InputError(f"priority: {priority} is outside the priorities this model admits from clients, "
                         f"{self.low} to {self.high} (parameter client_priority_range)")


DEFAULT_PRIORITY_RANGE = ClientPriorityRange()  # the parameter's default: only priority 0


def parse_client_priority_range(parameters: dict[str, str]) -> ClientPriorityRange:
    """The parameters ``client_priority_range`` and ``client_priority_clamp``; ConfigError naming them."""
    text = parameters.get("client_priority_range", "0").strip() or "0"
    low_text, _, high_text = text.partition(":")
    try:
        low = int(low_text)
        high = int(high_text) if high_text.strip() else low
    except ValueError:
        raise ConfigError(f"parameter 'client_priority_range': expected LOW:HIGH (integers), got {text!r}") from None
    if low > high or not -PRIORITY_LIMIT <= low or high >= PRIORITY_LIMIT:
        raise ConfigError(f"parameter 'client_priority_range': expected LOW <= HIGH, 32-bit integers, got {text!r}")
    clamp_text = parameters.get("client_priority_clamp", "false").strip().lower() or "false"
    if clamp_text not in ("true", "false"):
        raise ConfigError(f"parameter 'client_priority_clamp': expected true or false, got {clamp_text!r}")
    return ClientPriorityRange(low, high, clamp_text == "true")
