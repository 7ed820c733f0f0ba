"""Scheduler: token budget, chunk boundaries, running-before-waiting, preemption, rejection, and an
engine-loop simulation that checks every computed token's KV really belongs to the request."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.config import CacheConfig, SchedulerConfig
from backend.engine.request import Request, RequestStatus
from backend.engine.scheduler import Scheduler
from backend.kv_cache.manager import KVCacheManager
from backend.protocol.outputs import FinishReason
from backend.protocol.sampling import SamplingParams

FAKE_TOKEN = 7


def make_scheduler(
    num_blocks=64,
    block_size=16,
    max_num_batched_tokens=64,
    max_num_seqs=8,
    chunked=True,
    caching=True,
    max_model_len=4096,
):
    manager = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=chunked,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        max_model_len,
        manager,
    )


def make_request(request_id, num_prompt_tokens=None, max_tokens=4, prompt=None):
    if prompt is None:
        prompt = [hash((request_id, i)) % 1000 for i in range(num_prompt_tokens)]
    return Request(str(request_id), list(prompt), SamplingParams(max_tokens=max_tokens))


def plan(output):
    return [(item.request.request_id, item.num_new_tokens) for item in output.scheduled]


def sample(scheduler, output, token=FAKE_TOKEN):
    """The engine's part of a step: a token for each request whose chunk reached the end;
    finish at max_tokens. Returns the requests finished this step."""
    finished = []
    for item in output.scheduled:
        request = item.request
        if not item.is_last_chunk:
            continue
        request.append_output_token(token)
        if request.num_output_tokens >= request.sampling_params.max_tokens:
            scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH, FinishReason.LENGTH)
            finished.append(request)
    return finished


def test_chunk_boundaries_then_decode():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    request = make_request("a", 100, max_tokens=3)
    scheduler.add_request(request)
    steps = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        item = output.scheduled[0]
        steps.append((item.num_computed_tokens, item.num_new_tokens, item.is_last_chunk))
        assert len(item.block_ids) == -(-(item.num_computed_tokens + item.num_new_tokens) // 16)
        sample(scheduler, output)
    assert steps == [
        (0, 32, False),
        (32, 32, False),
        (64, 32, False),
        (96, 4, True),
        (100, 1, True),
        (101, 1, True),
    ]
    assert request.status == RequestStatus.FINISHED_LENGTH and request.num_output_tokens == 3
    assert request.first_scheduled_time is not None and request.num_cached_tokens == 0
    assert scheduler.kv_cache_manager.usage == 0.0


def test_running_before_waiting_and_budget():
    scheduler = make_scheduler(max_num_batched_tokens=20)
    a, b, c = make_request("a", 12), make_request("b", 12), make_request("c", 5)
    for request in (a, b, c):
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert plan(out) == [("a", 12), ("b", 8)] and out.num_scheduled_tokens == 20
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1
    sample(scheduler, out)
    out = scheduler.schedule()  # a decodes, b finishes its prompt, c is admitted after them
    assert plan(out) == [("a", 1), ("b", 4), ("c", 5)] and out.num_scheduled_tokens == 10
    assert [item.num_computed_tokens for item in out.scheduled] == [12, 8, 0]
    assert a.num_computed_tokens == 13 and b.num_computed_tokens == 12 and c.num_computed_tokens == 5


def test_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(i, 4))
    out = scheduler.schedule()
    assert plan(out) == [("0", 4), ("1", 4)] and scheduler.num_waiting == 1


def test_no_chunking_waits_in_arrival_order():
    scheduler = make_scheduler(max_num_batched_tokens=16, chunked=False)
    scheduler.add_request(make_request("a", 10, max_tokens=8))
    out = scheduler.schedule()
    sample(scheduler, out)
    scheduler.add_request(make_request("b", 16))
    scheduler.add_request(make_request("c", 2))
    out = scheduler.schedule()  # a takes 1 token; b (16) does not fit in 15; c must not skip b
    assert plan(out) == [("a", 1)] and [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_requests_that_can_never_fit_are_named_by_the_one_check():
    scheduler = make_scheduler(
        num_blocks=5, block_size=4, max_num_batched_tokens=8, chunked=False, max_model_len=20
    )
    too_long = make_request("long", 15, max_tokens=6)  # 21 > max_model_len
    too_big = make_request("big", 8, max_tokens=9)  # 17 tokens -> 5 blocks > 4 usable
    over_budget = make_request("budget", 9, max_tokens=1)  # no chunked prefill, 9 > 8
    empty = make_request("empty", 0)
    fine = make_request("fine", 8, max_tokens=8)  # 16 tokens -> exactly 4 blocks
    reasons = {r.request_id: scheduler.rejection_reason(r) for r in (too_long, too_big, over_budget, empty, fine)}
    assert "max_model_len" in reasons["long"] and "blocks" in reasons["big"]
    assert "max_num_batched_tokens" in reasons["budget"] and "empty" in reasons["empty"]
    assert reasons["fine"] is None
    with pytest.raises(AssertionError):  # the engine checks first; the scheduler only asserts
        scheduler.add_request(too_long)
    scheduler.add_request(fine)
    assert scheduler.num_waiting == 1 and plan(scheduler.schedule()) == [("fine", 8)]


def test_preempt_newest_to_waiting_front():
    # 6 usable blocks of 4 tokens; three 8-token prompts fill them exactly.
    scheduler = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64)
    a, b, c = (make_request(name, 8, max_tokens=4) for name in "abc")
    for request in (a, b, c):
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert plan(out) == [("a", 8), ("b", 8), ("c", 8)]
    sample(scheduler, out)
    d = make_request("d", 2)
    scheduler.add_request(d)
    out = scheduler.schedule()
    # a needs a 3rd block: c (newest) is preempted; b then takes the 2nd of c's freed blocks.
    assert plan(out) == [("a", 1), ("b", 1)] and out.preempted == [c]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert list(scheduler.waiting) == [c, d] and scheduler.num_preemptions == 1
    assert scheduler.kv_cache_manager.get_block_ids("c") == []
    # No admission in a step that preempted, even though d would fit in the budget.
    assert scheduler.num_running == 2


def test_preempting_itself_stops_the_running_loop():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, caching=False)
    a, b = make_request("a", 7), make_request("b", 8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    sample(scheduler, scheduler.schedule())
    out = scheduler.schedule()  # a fits in its 2 blocks; b needs a 3rd: b is the newest itself
    assert plan(out) == [("a", 1)] and out.preempted == [b]
    assert list(scheduler.waiting) == [b]
    # Preempted requests recompute prompt + outputs and keep their first num_cached_tokens.
    sample(scheduler, out)
    scheduler.finish_request(a, RequestStatus.FINISHED_STOPPED, FinishReason.EOS)
    out = scheduler.schedule()
    assert plan(out) == [("b", 9)] and b.num_cached_tokens == 0


def test_prefix_hit_sets_num_cached_tokens():
    scheduler = make_scheduler(block_size=4)
    prompt = list(range(10))
    a = make_request("a", prompt=prompt)
    scheduler.add_request(a)
    sample(scheduler, scheduler.schedule())
    b = make_request("b", prompt=prompt)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert plan(out) == [("a", 1), ("b", 2)]
    assert out.scheduled[1].num_computed_tokens == 8 and b.num_cached_tokens == 8
    manager = scheduler.kv_cache_manager
    assert out.scheduled[1].block_ids[:2] == manager.get_block_ids("a")[:2]
    assert manager.prefix_queries == 20 and manager.prefix_hits == 8


def test_abort_and_finish_free_blocks():
    scheduler = make_scheduler(block_size=4)
    a, b = make_request("a", 8), make_request("b", 8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    scheduler.schedule()
    c = make_request("c", 4)
    scheduler.add_request(c)
    assert scheduler.abort_request(c) and c.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.abort_request(a) and a.finish_reason == FinishReason.ABORT
    assert not scheduler.abort_request(a) and not scheduler.abort_request(make_request("zzz", 4))
    assert scheduler.num_running == 1 and scheduler.num_waiting == 0
    scheduler.finish_request(b, RequestStatus.FINISHED_STOPPED, FinishReason.STOP)
    assert b.status == RequestStatus.FINISHED_STOPPED and not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0.0
    with pytest.raises(ValueError):
        scheduler.finish_request(b, RequestStatus.FINISHED_STOPPED, FinishReason.STOP)


def run_engine(scheduler, requests, arrivals=None, max_steps=20_000):
    """Simulates the engine loop over a fake paged KV cache: each computed token writes its
    prefix identity into its slot; every computed token read later must carry the right one."""
    config = scheduler.scheduler_config
    block_size = scheduler.kv_cache_manager.block_size
    kv: dict[int, int] = {}  # slot -> hash of the token prefix whose KV was computed there
    pending = list(requests)
    arrivals = arrivals or [0] * len(pending)
    finished = []
    for step in range(max_steps):
        while pending and arrivals[len(requests) - len(pending)] <= step:
            request = pending.pop(0)
            reason = scheduler.rejection_reason(request)  # the engine's door
            if reason is None:
                scheduler.add_request(request)
            else:
                request.status, request.finish_reason, request.error = (
                    RequestStatus.FINISHED_ERROR, FinishReason.ERROR, reason)
                finished.append(request)
        if not pending and not scheduler.has_unfinished_requests():
            return finished
        out = scheduler.schedule()
        assert out.num_scheduled_tokens == sum(item.num_new_tokens for item in out.scheduled)
        assert out.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(out.scheduled) <= config.max_num_seqs and scheduler.num_running <= config.max_num_seqs
        if not config.enable_chunked_prefill:  # only a resumed request may be cut (see scheduler)
            assert all(item.is_last_chunk for item in out.scheduled if item.request.num_preemptions == 0)
        # Write the step's KV first (as the attention backends do), then check the reads.
        for item in out.scheduled:
            tokens = item.request.all_token_ids
            end = item.num_computed_tokens + item.num_new_tokens
            assert 0 < item.num_new_tokens and end <= len(tokens)
            assert len(item.block_ids) == -(-end // block_size) and 0 not in item.block_ids
            for pos in range(item.num_computed_tokens, end):
                kv[item.block_ids[pos // block_size] * block_size + pos % block_size] = hash(
                    tuple(tokens[: pos + 1])
                )
        for item in out.scheduled:
            tokens = item.request.all_token_ids
            for pos in range(item.num_computed_tokens + item.num_new_tokens):
                slot = item.block_ids[pos // block_size] * block_size + pos % block_size
                assert kv[slot] == hash(tuple(tokens[: pos + 1])), (item.request.request_id, pos)
        for item in out.scheduled:
            token = (item.request.num_tokens * 31 + len(item.request.request_id)) % 50
            finished.extend(sample(scheduler, out.__class__(scheduled=[item]), token=token))
    raise AssertionError("the engine loop did not finish: deadlock or livelock")


def test_many_long_requests_tiny_pool_all_finish():
    # 8 usable blocks of 4 tokens; each request needs up to 6 of them.
    scheduler = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    requests = [make_request(i, 10 + i % 5, max_tokens=10) for i in range(12)]
    finished = run_engine(scheduler, requests)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in requests)
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 10 for r in requests)
    assert scheduler.num_preemptions > 0
    manager = scheduler.kv_cache_manager
    assert manager.usage == 0.0 and manager.num_free_blocks == 8 and manager.req_to_blocks == {}


def test_shared_prefixes_tiny_pool_no_chunking():
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=24, chunked=False)
    system = list(range(100, 109))
    requests = [make_request(i, prompt=system + [i, i + 1], max_tokens=8) for i in range(10)]
    finished = run_engine(scheduler, requests, arrivals=[i // 3 for i in range(10)])
    assert len(finished) == 10 and all(r.num_output_tokens == 8 for r in requests)
    assert scheduler.kv_cache_manager.prefix_hits > 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 4]),
    num_usable_blocks=st.integers(3, 12),
    max_num_batched_tokens=st.integers(1, 24),
    max_num_seqs=st.integers(1, 5),
    chunked=st.booleans(),
    caching=st.booleans(),
)
def test_random_workloads_all_finish(
    data, block_size, num_usable_blocks, max_num_batched_tokens, max_num_seqs, chunked, caching
):
    scheduler = make_scheduler(
        num_blocks=num_usable_blocks + 1,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        chunked=chunked,
        caching=caching,
        max_model_len=num_usable_blocks * block_size,  # most requests fit, and crowd the pool
    )
    num_requests = data.draw(st.integers(1, 10))
    prompts = data.draw(
        st.lists(
            st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=num_requests, max_size=num_requests
        )
    )
    max_tokens = data.draw(st.lists(st.integers(1, 8), min_size=num_requests, max_size=num_requests))
    arrivals = sorted(data.draw(st.lists(st.integers(0, 4), min_size=num_requests, max_size=num_requests)))
    requests = [
        make_request(i, prompt=p, max_tokens=m)
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    finished = run_engine(scheduler, requests, arrivals)
    assert len(finished) == num_requests
    for request in requests:
        if request.status == RequestStatus.FINISHED_ERROR:
            assert request.error
        else:
            assert request.num_output_tokens == request.sampling_params.max_tokens
    assert scheduler.kv_cache_manager.usage == 0.0



def _prefilled(scheduler, *requests):
    """Schedules the prompts in one step, then gives each its first sampled token (to decode next)."""
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert plan(output) == [(r.request_id, r.num_prompt_tokens) for r in requests]
    for request in requests:
        request.append_output_token(FAKE_TOKEN)


def test_proposed_tokens_ride_along_within_the_budget_and_are_counted_in_it():
    scheduler = make_scheduler(max_num_batched_tokens=24)
    first, second = make_request("a", 16, max_tokens=16), make_request("b", 7, max_tokens=16)
    _prefilled(scheduler, first, second)
    first.spec.token_ids = list(range(100, 120))
    second.spec.token_ids = [5, 6, 7, 8]
    output = scheduler.schedule()
    assert plan(output) == [("a", 21), ("b", 3)]  # b keeps the 2 proposals the budget had room for
    assert output.scheduled[0].spec_token_ids == first.spec.token_ids and output.scheduled[1].spec_token_ids == [5, 6]
    assert output.scheduled[0].is_last_chunk and len(output.scheduled[0].block_ids) == 3  # 16 + 1 + 20 tokens


def test_proposals_never_take_the_block_a_later_request_needs():
    # 5 usable blocks; after the prompts a holds 1 and b 2, and each needs one more for its next
    # token: a's 16 proposals would take both free blocks, so a decodes without them and nobody is preempted.
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    first, second = make_request("a", 16, max_tokens=16), make_request("b", 32, max_tokens=16)
    _prefilled(scheduler, first, second)
    first.spec.token_ids = list(range(100, 116))
    output = scheduler.schedule()
    assert plan(output) == [("a", 1), ("b", 1)] and not output.preempted
    assert output.scheduled[0].spec_token_ids == [] and scheduler.kv_cache_manager.num_free_blocks == 0
