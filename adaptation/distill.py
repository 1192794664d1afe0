"""Self-distilled training text: the target answers training prompts itself (EAGLE-3's data recipe).

A drafter learns to predict the *target's* next tokens, so text the target wrote itself is what
it should be trained on (arXiv 2503.01840 §4); recorded answers written by another model (ShareGPT's
GPT-4 replies) teach it a distribution the target does not decode.

Pieces:

* :func:`plan_from_sharegpt` — a deterministic list of :class:`DistillItem` prompts (user turns
  of ShareGPT conversations after the trainer's held-out ones, labelled chat / code / math), with
  every conversation that overlaps a benchmark prompt (Spec-Bench and every packaged dataset)
  dropped (:func:`plan_items`).
* :class:`DistillConfig` — how each item is answered: per item, greedy with probability
  ``greedy_fraction``, else sampled at ``temperature`` / ``top_p``, seeded by the item index.
* :class:`Generator` — the protocol of a batched generation backend (``prompts, samplings ->
  continuations``); :class:`EngineGenerator` runs graftblock's :class:`~speculation.engine.batch.BatchEngine`
  (vanilla, N sequences per forward), :class:`HFGenerator` runs ``transformers``' ``generate`` (any
  device; the fast path on a GPU).
* :func:`distill` — answers the plan shard by shard (turn k of every item of a shard, then turn
  k+1 with the target's own earlier answers in the history, up to ``max_turns``), writing
  ``shard_NNNNN.jsonl.gz`` atomically plus ``manifest.json``. A killed run resumes at the first
  missing shard: no item is lost or answered twice.
* :func:`read_distilled` — the written conversations back, in plan order.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tqdm import tqdm

from adaptation.data import conversations, is_excluded, iter_sharegpt, normalize, spec_bench_texts
from adaptation.data import sharegpt_data, tokenize_conversation
from speculation import assets
from speculation.assets import encode_turn
from speculation.config import BatchConfig, ConfigError, SamplingConfig
from speculation.engine.batch import BatchEngine, Request

if TYPE_CHECKING:
    from adaptation.data import TrainData

MANIFEST = "manifest.json"
FORMAT = "graftblock-distill/1"


class Category(str, Enum):
    """What a prompt asks for (a keyword rule on its first user turn)."""

    CHAT = "chat"
    CODE = "code"
    MATH = "math"


_CODE = re.compile(r"```|\b(def|class|function|python|javascript|typescript|java|c\+\+|sql|regex|bash|"
                   r"code|script|compile|html|css|api|json)\b", re.IGNORECASE)
_MATH = re.compile(r"\b(calculate|solve|equation|integral|derivative|probability|how many|sum of|"
                   r"percent|average|algebra|geometry|prove|theorem)\b|\d+\s*[-+*/^=]\s*\d+", re.IGNORECASE)


def categorize(text: str) -> Category:
    """Code if the turn mentions code, else math if it reads as a calculation, else chat."""
    if _CODE.search(text):
        return Category.CODE
    if _MATH.search(text):
        return Category.MATH
    return Category.CHAT


@dataclass(frozen=True)
class DistillItem:
    """One prompt of the plan: the user turns of a conversation (answers are regenerated)."""

    item_id: str
    category: Category
    user_turns: tuple[str, ...]


def _check(name: str, ok: bool, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"distill.{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class DistillConfig:
    """How the plan is answered (``graftblock distill-data``)."""

    max_new_tokens: int = 512
    """Tokens per answer at most. Range [1, 8192]."""
    max_prompt_tokens: int = 1024
    """A turn whose prompt (history included) is longer is not asked; the item ends there. Range [16, 32768]."""
    max_turns: int = 3
    """User turns answered per item (multi-turn sources keep their later user turns). Range [1, 16]."""
    greedy_fraction: float = 0.5
    """Share of items answered greedily; the rest are sampled. Range [0, 1]."""
    temperature: float = 0.8
    """Sampling temperature of the sampled items (SpecForge's default). Range (0, 100]."""
    top_p: float = 1.0
    """Nucleus of the sampled items. Range (0, 1]."""
    shard_size: int = 64
    """Items per shard file (the unit of resumption). Range [1, 100000]."""
    seed: int = 0
    """Seeds the greedy/sampled split and every item's sampling seed. >= 0."""

    def __post_init__(self) -> None:
        _check("max_new_tokens", 1 <= self.max_new_tokens <= 8192, "in [1, 8192]", self.max_new_tokens)
        _check("max_prompt_tokens", 16 <= self.max_prompt_tokens <= 32768, "in [16, 32768]",
               self.max_prompt_tokens)
        _check("max_turns", 1 <= self.max_turns <= 16, "in [1, 16]", self.max_turns)
        _check("greedy_fraction", 0.0 <= self.greedy_fraction <= 1.0, "in [0, 1]", self.greedy_fraction)
        _check("temperature", 0.0 < self.temperature <= 100.0, "in (0, 100]", self.temperature)
        _check("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]", self.top_p)
        _check("shard_size", 1 <= self.shard_size <= 100_000, "in [1, 100000]", self.shard_size)
        _check("seed", self.seed >= 0, ">= 0", self.seed)

    def sampling(self, index: int) -> SamplingConfig:
        """Item ``index``'s sampling: greedy with probability ``greedy_fraction`` (a draw seeded by
        ``(seed, index)``), else temperature/top-p with seed ``seed * 1_000_003 + index``."""
        draw = random.Random(self.seed * 1_000_003 + index).random()
        if draw < self.greedy_fraction:
            return SamplingConfig(temperature=0.0)
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, seed=self.seed * 1_000_003 + index)


def benchmark_texts() -> set[str]:
    """Normalised turns of every benchmark prompt: Spec-Bench and every packaged dataset."""
    texts: set[str] = set()
    for name in (assets.SPEC_BENCH, *assets.PACKAGED_DATASETS):
        for q in assets.load_questions(name):
            texts.update(normalize(t) for t in q.turns)
    return texts


def plan_items(
    convs: Iterable[tuple[str, list[dict[str, str]]]], limit: int, excluded: set[str], min_turn_chars: int = 8
) -> list[DistillItem]:
    """The first ``limit`` usable ``(id, messages)`` conversations of ``convs`` as items.

    A conversation any of whose user turns equals or contains an ``excluded`` (benchmark) text,
    or whose first user turn is shorter than ``min_turn_chars``, is dropped.
    """
    longs = [t for t in excluded if len(t) >= 64]
    out: list[DistillItem] = []
    for cid, msgs in convs:
        users = tuple(m["content"] for m in msgs if m["role"] == "user")
        if len(users[0].strip()) < min_turn_chars or any(is_excluded(u, excluded, longs) for u in users):
            continue
        out.append(DistillItem(cid or f"item{len(out)}", categorize(users[0]), users))
        if len(out) >= limit:
            break
    return out


class Generator(Protocol):
    """A batched generation backend: continuations (EOS kept, prompt excluded) in input order."""

    name: str

    def generate(self, prompts: list[list[int]], samplings: list[SamplingConfig],
                 max_new_tokens: int) -> list[list[int]]: ...


class EngineGenerator:
    """graftblock's continuous-batching engine, vanilla (one target forward per step for all
    ``batch_size`` sequences; every request keeps its own sampling seed)."""

    name = "engine"

    def __init__(self, target: Any, batch_size: int, max_tokens_per_sequence: int) -> None:
        _check("batch_size", batch_size >= 1, ">= 1", batch_size)
        self.target = target
        self.batch_size = batch_size
        self.slot = max_tokens_per_sequence

    def generate(self, prompts: list[list[int]], samplings: list[SamplingConfig],
                 max_new_tokens: int) -> list[list[int]]:
        engine = BatchEngine(self.target, None, BatchConfig(max_sequences=self.batch_size,
                                                            max_tokens_per_sequence=self.slot))
        reqs = [Request(f"r{i}", list(p), max_new_tokens, s) for i, (p, s) in enumerate(zip(prompts, samplings))]
        res = engine.run(reqs)
        return [list(res[f"r{i}"].tokens) for i in range(len(prompts))]


class HFGenerator:
    """``transformers``' ``generate`` on the model's device, left-padded batches sorted by length;
    greedy and sampled items go in separate batches (sampled ones share the batch's seed)."""

    name = "hf"

    def __init__(self, model: Any, batch_size: int, eos_token_ids: Iterable[int], pad_token_id: int) -> None:
        _check("batch_size", batch_size >= 1, ">= 1", batch_size)
        self.model = model
        self.batch_size = batch_size
        self.eos = sorted(int(e) for e in eos_token_ids)
        self.pad = int(pad_token_id)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], samplings: list[SamplingConfig],
                 max_new_tokens: int) -> list[list[int]]:
        device = next(self.model.parameters()).device
        out: list[list[int]] = [[] for _ in prompts]
        groups: dict[tuple[float, float], list[int]] = {}
        for i, s in enumerate(samplings):
            key = (0.0, 1.0) if s.greedy else (s.temperature, s.top_p)
            groups.setdefault(key, []).append(i)
        eos = set(self.eos)
        for (temp, top_p), members in groups.items():
            members.sort(key=lambda i: len(prompts[i]))
            for b in range(0, len(members), self.batch_size):
                idx = members[b : b + self.batch_size]
                width = max(len(prompts[i]) for i in idx)
                ids = torch.full((len(idx), width), self.pad, dtype=torch.long)
                att = torch.zeros((len(idx), width), dtype=torch.long)
                for r, i in enumerate(idx):
                    ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
                    att[r, width - len(prompts[i]):] = 1
                kwargs: dict[str, Any] = {"do_sample": False}
                if temp > 0:
                    torch.manual_seed(samplings[idx[0]].seed)
                    kwargs = {"do_sample": True, "temperature": temp, "top_p": top_p, "top_k": 0}
                gen = self.model.generate(input_ids=ids.to(device), attention_mask=att.to(device),
                                          max_new_tokens=max_new_tokens, pad_token_id=self.pad,
                                          eos_token_id=self.eos or None, **kwargs)
                for r, i in enumerate(idx):
                    cut: list[int] = []
                    for t in gen[r, width:].tolist():
                        cut.append(t)
                        if t in eos:
                            break
                    out[i] = cut
        return out


def make_generator(backend: str, target, batch_size: int, cfg: DistillConfig) -> Generator:
    """The generation backend ``backend`` ("engine" | "hf") over a loaded ``TargetModel``."""
    if backend == "hf":
        return HFGenerator(target.model, batch_size, target.eos_token_ids, target.tokenizer.pad_token_id or 0)
    if backend != "engine":
        raise ValueError(f"distill: backend must be 'engine' or 'hf', got {backend!r}")
    return EngineGenerator(target, batch_size, cfg.max_prompt_tokens + cfg.max_new_tokens)


@dataclass
class DistillStats:
    """Counters of a distillation directory (one shard's, or the sum over its shards)."""

    shards_done: int = 0
    items: int = 0
    turns: int = 0
    new_tokens: int = 0
    wall_s: float = 0.0
    by_category: dict[str, int] = field(default_factory=dict)


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard_{index:05d}.jsonl.gz"


def _write_atomic(path: Path, write: Callable[[Any], None], binary: bool = False) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: replicas share a directory
    with (open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8")) as f:
        write(f)
    os.chmod(tmp, 0o644)
    tmp.replace(path)


def _strip_eos(tokens: list[int], eos: frozenset[int]) -> tuple[list[int], bool]:
    if tokens and tokens[-1] in eos:
        return tokens[:-1], True
    return tokens, False


def answer_shard(
    items: list[DistillItem], first_index: int, cfg: DistillConfig, tokenizer: Any, generator: Generator,
    eos: frozenset[int],
) -> tuple[list[dict], int, int]:
    """Every item of one shard answered turn by turn. Returns (records, turns, new tokens)."""
    samplings = [cfg.sampling(first_index + k) for k in range(len(items))]
    histories: list[list[tuple[str, str]]] = [[] for _ in items]
    live = list(range(len(items)))
    turns = tokens = 0
    for turn in range(cfg.max_turns):
        asked = []
        for k in live:
            if turn >= len(items[k].user_turns):
                continue
            ids = encode_turn(tokenizer, histories[k], items[k].user_turns[turn])
            if len(ids) <= cfg.max_prompt_tokens:
                asked.append((k, ids))
        if not asked:
            break
        conts = generator.generate([ids for _, ids in asked], [samplings[k] for k, _ in asked], cfg.max_new_tokens)
        live = []
        for (k, _), cont in zip(asked, conts):
            body, _ = _strip_eos(cont, eos)
            text = tokenizer.decode(body, skip_special_tokens=True).strip()
            tokens += len(cont)
            turns += 1
            if text:
                histories[k].append((items[k].user_turns[turn], text))
                live.append(k)
    records = []
    for k, item in enumerate(items):
        if not histories[k]:
            continue
        msgs = []
        for user, answer in histories[k]:
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        s = samplings[k]
        records.append({"id": item.item_id, "index": first_index + k, "category": item.category.value,
                        "sampling": {"temperature": s.temperature, "top_p": s.top_p, "seed": s.seed},
                        "messages": msgs})
    return records, turns, tokens


def distill(
    plan: list[DistillItem],
    out: str | Path,
    cfg: DistillConfig,
    tokenizer: Any,
    generator: Generator,
    eos: frozenset[int],
    meta: dict,
    progress: bool = True,
    on_shard: Callable[[DistillStats], None] | None = None,
    shards: Iterable[int] | None = None,
) -> DistillStats:
    """Answer ``plan`` into ``out`` (resumable). ``meta`` (target fingerprint, prompt source, ...)
    is the contract of the directory: a resumed run with other settings is refused.

    ``shards`` restricts the run to these shard indices (the Ray fan-out gives each replica its
    own); the manifest's counters are always the sum of the headers of the shards on disk."""
    root = Path(out)
    contract, n_shards = open_directory(plan, root, cfg, meta)
    todo = [s for s in (range(n_shards) if shards is None else shards) if not shard_path(root, s).is_file()]
    bar = None
    if progress:
        bar = tqdm(total=len(plan), initial=len(plan) - len(todo) * cfg.shard_size if todo else len(plan),
                   unit="prompt", desc="distill", dynamic_ncols=True)
    try:
        for s in todo:
            t0 = time.perf_counter()
            items = plan[s * cfg.shard_size : (s + 1) * cfg.shard_size]
            records, turns, tokens = answer_shard(items, s * cfg.shard_size, cfg, tokenizer, generator, eos)
            by_category: dict[str, int] = {}
            for r in records:
                by_category[r["category"]] = by_category.get(r["category"], 0) + 1
            header = {"shard": s, "stats": asdict(DistillStats(1, len(records), turns, tokens,
                                                               time.perf_counter() - t0, by_category))}
            lines = [json.dumps(header)] + [json.dumps(r, ensure_ascii=False) for r in records]
            payload = ("\n".join(lines) + "\n").encode()
            # The shard carries its own counters: a kill between the shard and the manifest loses none.
            _write_atomic(shard_path(root, s), lambda f: f.write(gzip.compress(payload, 9, mtime=0)), binary=True)
            stats = write_manifest(root, contract, n_shards)
            if bar is not None:
                bar.update(len(items))
                bar.set_postfix({"tok/s": f"{stats.new_tokens / max(stats.wall_s, 1e-9):.0f}"})
            if on_shard is not None:
                on_shard(stats)
    finally:
        if bar is not None:
            bar.close()
    return write_manifest(root, contract, n_shards)


def shard_count(plan: list[DistillItem], cfg: DistillConfig) -> int:
    return (len(plan) + cfg.shard_size - 1) // cfg.shard_size


def open_directory(plan: list[DistillItem], root: Path, cfg: DistillConfig, meta: dict) -> tuple[dict, int]:
    """Create ``root`` with its manifest, or check that the manifest there has this contract
    (format, config, plan and ``meta``); returns (contract, shard count)."""
    root.mkdir(parents=True, exist_ok=True)
    n_shards = shard_count(plan, cfg)
    contract = {"format": FORMAT, "config": asdict(cfg), "plan_items": len(plan),
                "plan_first_ids": [p.item_id for p in plan[:3]], **meta}
    mpath = root / MANIFEST
    if mpath.is_file():
        old = json.loads(mpath.read_text())
        if old.get("contract") != contract:
            keys = sorted(k for k in set(old.get("contract", {})) | set(contract)
                          if old.get("contract", {}).get(k) != contract.get(k))
            raise ConfigError(f"distill: {root} was written with other settings ({keys}); use another --out")
    else:
        write_manifest(root, contract, n_shards)
    return contract, n_shards


def _shard_lines(path: Path) -> Iterator[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def write_manifest(root: Path, contract: dict, n_shards: int) -> DistillStats:
    """Sum the counters in every shard's header into ``manifest.json``; returns the sums."""
    total = DistillStats()
    for path in sorted(root.glob("shard_*.jsonl.gz")):
        st = next(_shard_lines(path))["stats"]
        total.shards_done += 1
        total.items += st["items"]
        total.turns += st["turns"]
        total.new_tokens += st["new_tokens"]
        total.wall_s += st["wall_s"]
        for k, v in st["by_category"].items():
            total.by_category[k] = total.by_category.get(k, 0) + v
    manifest = {"contract": contract, "stats": asdict(total), "shards": n_shards,
                "complete": total.shards_done == n_shards,
                "tokens_per_s": total.new_tokens / max(total.wall_s, 1e-9)}
    _write_atomic(root / MANIFEST, lambda f: json.dump(manifest, f, indent=1))
    return total


def read_distilled(root: str | Path) -> Iterator[dict]:
    """The records of a distilled directory in plan order (shard by shard)."""
    root = Path(root)
    if not (root / MANIFEST).is_file():
        raise FileNotFoundError(f"{root} holds no {MANIFEST}: not a `graftblock distill-data` output")
    for path in sorted(root.glob("shard_*.jsonl.gz")):
        yield from itertools.islice(_shard_lines(path), 1, None)  # line 0: the shard's counters


def side_by_side_rates(tokenizer: Any, batched: Generator, single: Generator, plan: list[DistillItem],
                       cfg: DistillConfig, eos: frozenset[int], prompts: int) -> tuple[float, float]:
    """New tokens/s answering the first ``prompts`` items of ``plan`` (all their turns, the same
    samplings) with ``batched`` and then with ``single`` (one sequence at a time): the same work,
    timed back to back, so their ratio is the batching speed-up on this host."""
    items = plan[:prompts]
    rates = []
    for gen in (batched, single):
        t0 = time.perf_counter()
        _, _, tokens = answer_shard(items, 0, cfg, tokenizer, gen, eos)
        rates.append(tokens / max(time.perf_counter() - t0, 1e-9))
    return rates[0], rates[1]


def plan_from_sharegpt(path: str | Path, heldout: int, limit: int) -> list[DistillItem]:
    """The plan over a ShareGPT file: after the trainer's ``heldout`` conversations, benchmark
    prompts excluded. (:func:`adaptation.data.conversations` drops Spec-Bench first-turn matches
    before counting, exactly as the trainer's hold-out does, so the skip lines up with it.)"""
    rest = itertools.islice(conversations(iter_sharegpt(path), spec_bench_texts()), heldout, None)
    return plan_items(rest, limit, benchmark_texts())


def distilled_data(tokenizer: Any, target: Any, root: str | Path, max_len: int, heldout: int,
                   sharegpt: str | None = None) -> "TrainData":
    """:class:`~adaptation.data.TrainData` over a ``graftblock distill-data`` directory.

    Training items are the distilled conversations (the target's own answers), in plan order;
    the held-out samples and tau prompts stay the ShareGPT ones of
    :func:`~adaptation.data.sharegpt_data` (recorded answers), so held-out figures compare with
    runs trained on recorded text. The directory must have been planned after the same
    ``heldout`` conversations of the same ShareGPT file, else a held-out prompt could be trained
    on: a mismatch is a :class:`ConfigError` naming both values.
    """
    root = Path(root)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise ConfigError(f"train: --distilled {root} holds no {MANIFEST}; write it with `graftblock distill-data`")
    manifest = json.loads(manifest_path.read_text())
    contract = manifest["contract"]
    if contract.get("heldout") != heldout:
        raise ConfigError(f"train: --distilled {root} was planned after {contract.get('heldout')} held-out "
                          f"conversations but --heldout is {heldout}; use --heldout {contract.get('heldout')}")
    if contract.get("sharegpt") != (sharegpt or "packaged"):
        raise ConfigError(f"train: --distilled {root} was planned from ShareGPT {contract.get('sharegpt')!r}, "
                          f"not {sharegpt or 'packaged'!r}; pass the same --sharegpt")
    if not manifest.get("complete"):
        raise ConfigError(f"train: --distilled {root} is incomplete ({manifest['stats']['shards_done']} of "
                          f"{manifest['shards']} shards); finish it by re-running its distill-data command")
    base = sharegpt_data(tokenizer, target, max_len=max_len, heldout=heldout, path=sharegpt)

    def items() -> Iterator[tuple[str, list[dict[str, str]]]]:
        return ((r["id"], r["messages"]) for r in read_distilled(root))

    def to_samples(batch: list[tuple[str, list[dict[str, str]]]]) -> list:
        out = [tokenize_conversation(tokenizer, msgs, max_len, cid) for cid, msgs in batch]
        return [s for s in out if s is not None]

    def vocab_samples() -> Iterator:
        for cid, msgs in items():
            s = tokenize_conversation(tokenizer, msgs, max_len, cid)
            if s is not None:
                yield s

    description = {**base.description, "source": f"distilled:{root.name}",
                   "distilled": {k: contract[k] for k in ("format", "config", "plan_items", "target", "generator")
                                 if k in contract},
                   "distilled_new_tokens": manifest["stats"]["new_tokens"]}
    return replace(base, items=items, to_samples=to_samples, vocab_samples=vocab_samples, description=description)
