"""Reasoning parsers (openai_front/reasoning.py): a whole output and the same output in any chunks split the same."""

from __future__ import annotations

import pytest

from openai_front.reasoning import ReasoningSplitter, split

CASES = [
    # (parser, output, reasoning, content)
    ("qwen3", "<think>Add them: 5.</think>\n\nThe sum is 5.", "Add them: 5.", "\n\nThe sum is 5."),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "No thinking here, <think> later is text.", "", "No thinking here, <think> later is text."),
    ("qwen3", "<think>cut short", "cut short", ""),
    ("qwen3", "<thi", "", "<thi"),  # a tag that never came is content
    ("deepseek_r1", "Let me see.</think>Paris.", "Let me see.", "Paris."),
    ("deepseek_r1", "<think>Let me see.</think>Paris.", "Let me see.", "Paris."),
    ("deepseek_r1", "still thinking", "still thinking", ""),
    ("deepseek_r1", "é </think> ü </thi", "é ", " ü </thi"),
]


def chunked(parser: str, pieces: list[str]) -> tuple[str, str]:
    splitter, reasoning, content = ReasoningSplitter(parser), "", ""
    for index, piece in enumerate(pieces):
        r, c = splitter.feed(piece, final=index == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize(("parser", "output", "reasoning", "content"), CASES)
def test_whole_and_chunked_outputs_split_alike(parser, output, reasoning, content):
    assert split(parser, output) == (reasoning, content)
    assert chunked(parser, list(output)) == (reasoning, content)  # a character at a time
    for cut in range(1, len(output)):
        assert chunked(parser, [output[:cut], output[cut:]]) == (reasoning, content), cut


def test_no_delta_ever_holds_a_piece_of_a_tag():
    splitter = ReasoningSplitter("qwen3")
    deltas = [splitter.feed(c) for c in "<think>ab</think>cd"]
    for reasoning, content in deltas:
        assert "<" not in reasoning and "<" not in content
    assert "".join(r for r, _ in deltas) == "ab" and "".join(c for _, c in deltas) == "cd"


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="reasoning parser"):
        ReasoningSplitter("mystery")


def test_a_chat_answer_carries_reasoning_apart_whole_and_streamed():
    import json

    from openai_front.responses import Choice, ChunkWriter, Reasoning, Usage, full_response

    text = "<think>5 + 3 = 8</think>The answer is 8."
    body = full_response("chatcmpl-1", True, "llm", [Choice(0, text, "stop")], Usage(3, 4), None,
                         reasoning=Reasoning("qwen3"))
    message = body["choices"][0]["message"]
    assert message["content"] == "The answer is 8."
    assert message["reasoning"] == message["reasoning_content"] == "5 + 3 = 8"
    hidden = full_response("chatcmpl-1", True, "llm", [Choice(0, text, "stop")], Usage(3, 4), None,
                           reasoning=Reasoning("qwen3", include=False))["choices"][0]["message"]
    assert hidden == {"role": "assistant", "content": "The answer is 8."}
    plain = full_response("chatcmpl-1", True, "llm", [Choice(0, text, "stop")], Usage(3, 4), None)
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": text}

    writer = ChunkWriter("chatcmpl-1", True, "llm", None, Reasoning("qwen3"))
    pieces = ["<th", "ink>5 + 3", " = 8</th", "ink>The answer", " is 8."]
    events = "".join(writer.delta(0, piece, "stop" if i == len(pieces) - 1 else None, [])
                     for i, piece in enumerate(pieces))
    deltas = [json.loads(line[len("data: "):])["choices"][0]["delta"] for line in events.split("\n\n") if line]
    assert "".join(d.get("reasoning", "") for d in deltas) == "5 + 3 = 8"
    assert "".join(d.get("content") or "" for d in deltas) == "The answer is 8."
    assert all("<" not in (d.get("content") or "") + d.get("reasoning", "") for d in deltas)
