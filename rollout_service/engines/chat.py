"""Chat prompts: the served checkpoint's chat template applied to a conversation.

Runs in the rollout service process, on the tokenizer each engine holds (vLLM's own;
for SGLang, one loaded from the checkpoint with ``transformers``), so a chat prompt
is exactly what the checkpoint's template makes of the turns, tokenized as the
engine tokenizes. A checkpoint without a template (``chat_template`` in its
``tokenizer_config.json``, or a ``chat_template.jinja``) serves no chat.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_service.engines.base import ChatTurn, InvalidRequestError

NO_TEMPLATE = ("messages: the served checkpoint has no chat template (no 'chat_template' in "
               "its tokenizer_config.json); send the prompt as text to /v1/completions")


def chat_prompt_ids(tokenizer: Any, turns: Sequence[ChatTurn]) -> list[int]:
    """Render ``turns`` with the tokenizer's chat template (generation prompt added) and
    tokenize the text without adding special tokens again (the template places them).

    Args:
        tokenizer: a Hugging Face tokenizer (``chat_template``, ``apply_chat_template``,
            ``encode``), or None when the checkpoint has none.

    Raises:
        InvalidRequestError: no template, or the template refuses these turns.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(NO_TEMPLATE)
    conversation = [{"role": turn.role, "content": turn.content} for turn in turns]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # jinja2 errors, the template's raise_exception
        raise InvalidRequestError(f"messages: the chat template refused them: {exc}") from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


def load_tokenizer(model_path: str) -> Any:
    """The checkpoint's Hugging Face tokenizer (``transformers``, imported here), or None
    when none loads from it (such a checkpoint serves no chat)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
