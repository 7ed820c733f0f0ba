"""scheduling_policy priority (vLLM's): waiting requests run in (priority, arrival) order, a waiting
request preempts a running one of a lower priority for its seat or its blocks, and the blocks run
out on the lowest priority first; fcfs ignores priorities. Preempted requests still produce exactly
their tokens (greedy, engine)."""

from __future__ import annotations

from backend.config import CacheConfig, SchedulerConfig, engine_config_from_model_folder
from backend.engine.llm_engine import LLMEngine
from backend.engine.request import Request
from backend.engine.scheduler import Scheduler
from backend.kv_cache.manager import KVCacheManager
from backend.protocol.sampling import SamplingParams
from tests.conftest import DEMO_REPOSITORY


def scheduler(policy="priority", max_num_seqs=8, num_blocks=64, budget=64):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     scheduling_policy=policy),
                     CacheConfig(block_size=16), 4096, KVCacheManager(num_blocks, 16, True))


def request(name, priority, num_tokens=8, arrival=0.0, max_tokens=4):
    return Request(name, [hash((name, i)) % 1000 for i in range(num_tokens)],
                   SamplingParams(max_tokens=max_tokens, priority=priority), arrival_time=arrival)


def scheduled_ids(output):
    return [item.request.request_id for item in output.scheduled]


def test_waiting_requests_run_by_priority_then_arrival():
    s = scheduler(max_num_seqs=2)
    for name, priority, arrival in (("late-batch", 5, 1.0), ("early-batch", 5, 0.0), ("chat", 0, 2.0), ("urgent", -1, 3.0)):
        s.add_request(request(name, priority, arrival=arrival))
    assert [r.request_id for r in s.waiting] == ["urgent", "chat", "early-batch", "late-batch"]
    assert scheduled_ids(s.schedule()) == ["urgent", "chat"]


def test_fcfs_ignores_priorities():
    s = scheduler(policy="fcfs", max_num_seqs=2)
    for index, priority in enumerate((5, 0, -1)):
        s.add_request(request(f"r{index}", priority, arrival=float(index)))
    assert scheduled_ids(s.schedule()) == ["r0", "r1"]


def test_a_higher_priority_request_takes_the_seat_of_the_lowest_running_one():
    s = scheduler(max_num_seqs=2)
    s.add_request(request("batch-a", 5, arrival=0.0))
    s.add_request(request("batch-b", 6, arrival=1.0))
    for item in s.schedule().scheduled:  # as the engine does: a token each
        item.request.append_output_token(1)
    s.add_request(request("chat", 0, arrival=2.0))
    output = s.schedule()
    assert [r.request_id for r in output.preempted] == ["batch-b"]
    assert sorted(scheduled_ids(output)) == ["batch-a", "chat"]  # batch-b's share of the step was taken back
    assert [r.request_id for r in s.waiting] == ["batch-b"] and s.waiting[0].num_computed_tokens == 0
    # An equal priority waits for a seat instead.
    s.add_request(request("batch-c", 5, arrival=3.0))
    assert s.schedule().preempted == []


def test_blocks_run_out_on_the_lowest_priority_first():
    s = scheduler(max_num_seqs=4, num_blocks=7, budget=256)  # 6 usable blocks of 16 tokens
    s.add_request(request("low", 9, num_tokens=32, arrival=0.0, max_tokens=64))
    s.add_request(request("high", 0, num_tokens=32, arrival=1.0, max_tokens=64))
    first = s.schedule()
    assert sorted(scheduled_ids(first)) == ["high", "low"]
    for item in first.scheduled:  # as the engine does: a token each
        item.request.append_output_token(1)
    # 64 tokens in 4 blocks; the pool has 2 left: a long third request of the highest priority.
    s.add_request(request("urgent", -5, num_tokens=40, arrival=2.0, max_tokens=8))
    output = s.schedule()
    assert [r.request_id for r in output.preempted] == ["low"]
    assert "urgent" in scheduled_ids(output) and "high" in scheduled_ids(output)


def test_preempted_low_priority_requests_keep_their_greedy_tokens(demo_model_dir):
    folder = str(DEMO_REPOSITORY / "llm")
    alone = LLMEngine(engine_config_from_model_folder(folder))
    prompts = [[1, 10 + i, 20, 30, 40] for i in range(3)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, priority=p) for p in (5, 5, 0)]
    expected = [r.output_token_ids for r in alone.generate(prompts, params)]
    engine = LLMEngine(engine_config_from_model_folder(folder, scheduling_policy="priority", max_num_seqs="2"))
    engine.add_request("batch-0", prompt_token_ids=prompts[0], sampling_params=params[0])
    engine.add_request("batch-1", prompt_token_ids=prompts[1], sampling_params=params[1])
    tokens = {"batch-0": [], "batch-1": [], "chat": []}
    first_chat_step = None
    for step in range(200):
        if step == 3:
            engine.add_request("chat", prompt_token_ids=prompts[2], sampling_params=params[2])
        for output in engine.step().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
            if output.request_id == "chat" and first_chat_step is None:
                first_chat_step = step
        if not engine.has_unfinished_requests():
            break
    assert first_chat_step == 3  # admitted at once, ahead of the batch requests holding both seats
    assert engine.scheduler.num_preemptions >= 1
    assert [tokens["batch-0"], tokens["batch-1"], tokens["chat"]] == expected
