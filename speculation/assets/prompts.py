"""Prompt building: a conversation's token ids ready for the model's next reply."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover - imported lazily at run time (slow import)
    from transformers import PreTrainedTokenizerBase


def _flat_ids(encoded: Any) -> list[int]:
    if hasattr(encoded, "keys") and "input_ids" in encoded:  # BatchEncoding / dict
        encoded = encoded["input_ids"]
    if isinstance(encoded, torch.Tensor):
        encoded = encoded.tolist()
    elif hasattr(encoded, "tolist"):  # numpy
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], (list, tuple)):
        if len(encoded) != 1:
            raise ValueError(f"expected one sequence of token ids, got a batch of {len(encoded)}")
        encoded = encoded[0]
    return [int(t) for t in encoded]


def encode_turn(tokenizer: "PreTrainedTokenizerBase", history: list[tuple[str, str]], user: str) -> list[int]:
    """Token ids of a conversation ready for the model's next (assistant) reply.

    ``history`` holds the earlier ``(user, assistant)`` turns, ``user`` is the new
    user message. With a chat template the conversation goes through
    ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``. A
    tokenizer without a chat template (e.g. a base model such as Gemma 3 270M)
    gets a plain transcript instead, with the tokenizer's usual special tokens
    (BOS) added::

        User: <first message>
        Assistant: <first answer>
        User: <new message>
        Assistant:
    """
    if not isinstance(user, str) or not user.strip():
        raise ValueError("prompt is empty")
    if getattr(tokenizer, "chat_template", None):
        messages: list[dict[str, str]] = []
        for prev_user, prev_answer in history:
            messages.append({"role": "user", "content": prev_user})
            messages.append({"role": "assistant", "content": prev_answer})
        messages.append({"role": "user", "content": user})
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return _flat_ids(encoded)
    lines = []
    for prev_user, prev_answer in history:
        lines.append(f"User: {prev_user}\nAssistant: {prev_answer}\n")
    lines.append(f"User: {user}\nAssistant:")
    return _flat_ids(tokenizer("".join(lines))["input_ids"])
