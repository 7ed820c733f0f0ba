"""The vLLM backend's return_* outputs: which values each response carries with and without the flags."""

from __future__ import annotations

from backend.protocol.outputs import FinishReason, RequestOutput
from backend.triton.helpers import build_response
from backend.triton.inputs import ReturnOptions
from backend.triton.return_outputs import finish_reason_text, logprob_entries, token_counts


def output(finished: bool = False, reason: FinishReason | None = None, **extra) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=extra.pop("ids", [7]), text="x", finished=finished,
                         finish_reason=reason, num_prompt_tokens=11, num_output_tokens=extra.pop("total", 3), **extra)


def test_finish_reason_is_ours_by_default_and_vllms_on_request():
    ours, vllm = ReturnOptions(), ReturnOptions(finish_reason=True)
    assert finish_reason_text(ours, None) == "" and finish_reason_text(vllm, None) == "None"
    final = output(True, FinishReason.EOS)
    assert finish_reason_text(ours, final) == "eos" and finish_reason_text(vllm, final) == "stop"
    length = output(True, FinishReason.LENGTH)
    assert finish_reason_text(vllm, length) == "length"


def test_counts_are_final_totals_by_default_and_per_response_on_request():
    middle, final = output(total=2), output(True, FinishReason.LENGTH, total=5)
    assert token_counts(ReturnOptions(), middle, 1, None) == (None, None)
    assert token_counts(ReturnOptions(), final, 1, final) == (11, 5)
    flags = ReturnOptions(num_input_tokens=True, num_output_tokens=True)
    assert token_counts(flags, middle, 1, None) == (11, 1)
    assert token_counts(flags, final, 2, final) == (11, 2)  # the tokens of this response, summed by clients


class FakeTokenizer:
    def decode(self, ids):
        return f"<{ids[0]}>"


def test_logprob_entries_hold_the_chosen_token_and_its_alternatives_once_each():
    first = output(ids=[5], logprobs=[-0.1], logprob_ranks=[1], top_logprobs=[[(5, -0.1), (9, -2.5)]])
    second = output(ids=[4], logprobs=[-3.0], logprob_ranks=[2], top_logprobs=[[(8, -0.2), (4, -3.0)]])
    entries = logprob_entries(FakeTokenizer(), [first, second, output(ids=[6])])  # the last asked for none
    assert entries == [
        {"5": {"logprob": -0.1, "rank": 1, "decoded_token": "<5>"}, "9": {"logprob": -2.5, "rank": 2, "decoded_token": "<9>"}},
        {"4": {"logprob": -3.0, "rank": 2, "decoded_token": "<4>"}, "8": {"logprob": -0.2, "rank": 1, "decoded_token": "<8>"}},
    ]


class FakePb:
    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

    class InferenceResponse:
        def __init__(self, output_tensors):
            self.tensors = {t.name: t.array for t in output_tensors}


def test_num_cached_tokens_travels_with_num_input_tokens_and_only_when_asked_for():
    response = build_response(FakePb, "x", [7], "", 11, 3, num_cached_tokens=8)
    assert response.tensors["num_input_tokens"].tolist() == [[11]]
    assert response.tensors["num_cached_tokens"].tolist() == [[8]]
    assert "num_cached_tokens" not in build_response(FakePb, "x", [7]).tensors
    unasked = build_response(FakePb, "x", [7], "", 11, 3, requested=frozenset({"text_output"}), num_cached_tokens=8)
    assert set(unasked.tensors) == {"text_output"}
