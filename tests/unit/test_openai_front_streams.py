"""openai_front's generation plumbing without a server: merging, idle timeouts, disconnects, cleanup."""

from __future__ import annotations

import asyncio

import pytest

from openai_front.errors import ApiError
from openai_front.generation import ClientGone, Generation
from openai_front.generation import merged as _merged  # the tests name their results merged
from openai_front.triton_bridge import Piece


def piece(index: int, text: str) -> Piece:
    return Piece(index, text, 1, 3, None)


class Source:
    """An async generator standing in for TritonBridge.generate; notes whether it was closed."""

    def __init__(self, pieces, delay: float = 0.0, fail: Exception | None = None):
        self.pieces, self.delay, self.fail = pieces, delay, fail
        self.closed = False

    async def run(self):
        try:
            for p in self.pieces:
                await asyncio.sleep(self.delay)
                yield p
            if self.fail is not None:
                raise self.fail
        finally:
            self.closed = True  # where the real one cancels its gRPC call


class Disconnecting:
    def __init__(self, after_polls: int):
        self.polls, self.after = 0, after_polls

    async def is_disconnected(self) -> bool:
        self.polls += 1
        return self.polls > self.after


def test_merged_generations_number_choices_by_prompt_and_sample():
    async def run():
        first, second = Source([piece(0, "a"), piece(1, "b")]), Source([piece(0, "c"), piece(1, "d")], delay=0.001)
        merged = [(i, p.text) async for i, p in _merged([first.run(), second.run()], n=2)]
        return merged, first.closed and second.closed

    merged, closed = asyncio.run(run())
    assert sorted(merged) == [(0, "a"), (1, "b"), (2, "c"), (3, "d")] and closed


def test_an_error_in_one_generation_ends_all_of_them():
    async def run():
        bad = Source([piece(0, "a")], fail=ApiError(400, "max_tokens: too many", "max_tokens"))
        slow = Source([piece(0, "x")] * 100, delay=0.01)
        with pytest.raises(ApiError):
            async for _ in _merged([bad.run(), slow.run()], n=1):
                pass
        await asyncio.sleep(0)
        return bad.closed, slow.closed

    assert asyncio.run(run()) == (True, True)


def test_silence_from_triton_is_a_504_and_closes_the_generation():
    async def run(request):
        source = Source([piece(0, "late")], delay=5.0)
        generation = Generation(_merged([source.run()], 1), idle_timeout_s=0.2)
        with pytest.raises(ApiError) as timed_out:
            await generation.next(request)
        await generation.close()
        return timed_out.value.status, source.closed

    assert asyncio.run(run(None)) == (504, True)  # streaming: no disconnect polling
    assert asyncio.run(run(Disconnecting(after_polls=10**6))) == (504, True)


def test_a_client_gone_before_the_first_token_cancels_the_generation():
    async def run():
        source = Source([piece(0, "never")], delay=5.0)
        generation = Generation(_merged([source.run()], 1), idle_timeout_s=60)
        request = Disconnecting(after_polls=2)
        with pytest.raises(ClientGone):
            await generation.next(request)
        await generation.close()
        return source.closed, request.polls

    closed, polls = asyncio.run(run())
    assert closed and polls == 3  # noticed on the first poll that saw the disconnect


def test_a_stream_silent_across_a_model_reload_ends_with_a_503(monkeypatch):
    import openai_front.generation as generation_module
    import openai_front.orphan_watch as orphan_module
    from openai_front.orphan_watch import OrphanWatch

    monkeypatch.setattr(generation_module, "ORPHAN_CHECK_SECONDS", 0.05)
    monkeypatch.setattr(orphan_module, "ORPHAN_CHECK_SECONDS", 0.05)
    states = iter([True, False, False, True])

    async def ready():
        return next(states, True)

    async def run():
        source = Source([piece(0, "never")], delay=30.0)
        generation = Generation(_merged([source.run()], 1), idle_timeout_s=20.0, orphans=OrphanWatch(ready))
        started = asyncio.get_running_loop().time()
        with pytest.raises(ApiError) as orphaned:
            await generation.next()
        await generation.close()
        return orphaned.value, asyncio.get_running_loop().time() - started, source.closed

    error, seconds, closed = asyncio.run(run())
    assert error.status == 503 and error.code == "model_reloaded" and "retry" in error.message
    assert seconds < 2.0 and closed


def test_a_stream_that_keeps_talking_through_an_unready_model_is_left_alone(monkeypatch):
    import openai_front.generation as generation_module
    import openai_front.orphan_watch as orphan_module
    from openai_front.orphan_watch import OrphanWatch

    monkeypatch.setattr(generation_module, "ORPHAN_CHECK_SECONDS", 0.06)
    monkeypatch.setattr(orphan_module, "ORPHAN_CHECK_SECONDS", 0.06)
    flips = iter([False, True] * 100)

    async def ready():  # one check per silence: unready in one, ready again in the next
        return next(flips, True)

    async def run():
        source = Source([piece(0, str(i)) for i in range(6)], delay=0.1)
        generation = Generation(_merged([source.run()], 1), idle_timeout_s=5.0, orphans=OrphanWatch(ready))
        texts = []
        while (item := await generation.next()) is not None:
            texts.append(item[1].text)
        return texts

    assert asyncio.run(run()) == [str(i) for i in range(6)]
