"""The `tokenizer` model's chat prompts: `llm`'s own chat rendering, on the model's one tokenizer.

The prompt is ``InputProcessor.render_chat``'s, the one function `llm` renders chats with, on the
tokenizer backend.engine.tokenizer.load_tokenizer gives both models, so both see the same text for
the same messages.
"""

from __future__ import annotations

from backend.engine.input_processor import InputProcessor


class ChatRenderer:
    def __init__(self, tokenizer):
        """``tokenizer``: the folder's transformers tokenizer, from backend.engine.tokenizer.load_tokenizer."""
        # Renders chats only: max_model_len is read by the sampling check, which never runs here.
        self._processor = InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=0)

    def render(self, messages: list[dict[str, str]]) -> str:
        """The chat's prompt, with the generation prompt; tokenize it with add_special_tokens false.

        Raises EngineInputError naming ``messages``.
        """
        return self._processor.render_chat(messages)
