"""The `tokenizer` model's chat prompts: `llm`'s own chat rendering, on a tokenizer loaded in the background.

Rendering a chat template needs transformers' tokenizer (a second or two to load), which text <->
ids never need. It loads in a thread started with the model, so the model is ready at once and
only a ``messages`` request waits for it. The prompt is ``InputProcessor.render_chat``'s, the one
function `llm` renders chats with, so both models see the same text for the same messages.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from backend.engine.input_processor import EngineInputError, InputProcessor

logger = logging.getLogger(__name__)


class ChatRenderer:
    def __init__(self, folder: str):
        """Starts loading ``folder``'s tokenizer (as `llm` loads it) in a daemon thread."""
        self._processor: Future[InputProcessor] = Future()
        threading.Thread(target=self._load, args=(folder,), name="chat-tokenizer", daemon=True).start()

    def _load(self, folder: str) -> None:
        try:
            from backend.engine.tokenizer import load_tokenizer  # noqa: PLC0415 (transformers: off the load path)

            tokenizer = load_tokenizer(folder)
            # Renders chats only: max_model_len is read by the sampling check, which never runs here.
            self._processor.set_result(InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=0))
        except Exception as exc:
            logger.exception("loading the chat tokenizer from %s failed", folder)
            self._processor.set_exception(exc)

    def render(self, messages: list[dict[str, str]]) -> str:
        """The chat's prompt, with the generation prompt; tokenize it with add_special_tokens false.

        Waits for the tokenizer to load. Raises EngineInputError naming ``messages``.
        """
        try:
            processor = self._processor.result()
        except Exception as exc:
            raise EngineInputError(f"messages: the chat tokenizer did not load ({type(exc).__name__}: {exc})") from None
        return processor.render_chat(messages)
