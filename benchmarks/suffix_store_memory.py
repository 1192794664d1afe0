"""Memory, insert and lookup cost of the cross-request suffix store, per million stored tokens.

    .venv/bin/python benchmarks/suffix_store_memory.py --json benchmarks/results/suffix_store_memory.json

Documents are real assistant replies: the ``gpt`` turns of the packaged ShareGPT file, one
conversation's replies per document (what a serving replica would store), tokenized with
SmolLM2's tokenizer. Two runs:

1. ``fill``: a store of ``--tokens`` capacity filled to capacity; memory is what ``tracemalloc``
   sees allocated by the store (Python objects and numpy buffers), divided per million tokens.
2. ``bounded``: the same stream into a store of a quarter of that capacity, so three quarters of
   it is evicted on the way; the store must stay within its bound, and its memory with it.

Lookups are timed on contexts cut from conversations that were not stored (held out), so the
match rate is that of unseen traffic against the store, not of a document against itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from adaptation.data import iter_sharegpt
from speculation import assets
from speculation.bench.runner import emit_json, environment
from speculation.drafters.suffix_store import SuffixStore

HELD_OUT = 200  # conversations kept out of the store, for lookup contexts


def _documents(limit_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    tok = assets.load_tokenizer("smollm2-135m")
    docs: list[list[int]] = []
    held: list[list[int]] = []
    total = 0
    for item in iter_sharegpt(assets.sharegpt_path()):
        replies = [t.get("value", "") for t in item.get("conversations", []) if t.get("from") == "gpt"]
        text = "\n".join(r for r in replies if isinstance(r, str) and r.strip())
        if not text:
            continue
        ids = tok(text)["input_ids"]
        if len(ids) < 16:
            continue
        if len(held) < HELD_OUT:
            held.append(ids)
            continue
        docs.append(ids)
        total += len(ids)
        if total >= limit_tokens:
            break
    return docs, held


def _fill(docs: list[list[int]], capacity: int) -> tuple[SuffixStore, dict]:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    store = SuffixStore(max_tokens=capacity)
    t0 = time.perf_counter()
    fed = 0
    for d in docs:
        store.add(d)
        fed += len(d)
    add_s = time.perf_counter() - t0
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    stats = store.stats()
    return store, {
        "capacity_tokens": capacity,
        "fed_tokens": fed,
        "stored_tokens": stats["tokens"],
        "docs": stats["docs"],
        "evicted_docs": stats["evicted_docs"],
        "keys": stats["keys"],
        "entries": stats["entries"],
        "traced_bytes": used,
        "payload_bytes": stats["payload_bytes"],
        "mib_per_million_tokens": used / 2**20 / (stats["tokens"] / 1e6),
        "add_tokens_per_s": fed / add_s,
    }


def _lookups(store: SuffixStore, held: list[list[int]], n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    times, lengths = [], []
    for _ in range(n):
        doc = held[int(rng.integers(len(held)))]
        cut = int(rng.integers(8, len(doc)))
        ctx = doc[max(0, cut - 64) : cut]
        t0 = time.perf_counter()
        hit = store.lookup(ctx, max_depth=12)
        times.append(time.perf_counter() - t0)
        lengths.append(hit.length if hit is not None else 0)
    matched = [x for x in lengths if x]
    return {
        "lookups": n,
        "median_us": 1e6 * statistics.median(times),
        "p90_us": 1e6 * sorted(times)[int(0.9 * n)],
        "match_rate": len(matched) / n,
        "mean_match_len": sum(matched) / len(matched) if matched else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=1_000_000, help="fill capacity in tokens, 10^4..10^8")
    ap.add_argument("--lookups", type=int, default=2000)
    args = ap.parse_args(argv)
    if not 10_000 <= args.tokens <= 100_000_000:
        ap.error(f"--tokens must be in [10000, 100000000], got {args.tokens}")
    docs, held = _documents(args.tokens)
    store, fill = _fill(docs, args.tokens)
    fill.update(_lookups(store, held, args.lookups))
    del store
    store, bounded = _fill(docs, args.tokens // 4)
    bounded.update(_lookups(store, held, args.lookups))
    out = {"kind": "suffix_store_memory", "env": environment(), "tokenizer": "smollm2-135m",
           "source": "ShareGPT_V3 gpt turns (packaged)", "fill": fill, "bounded": bounded,
           "command": "python benchmarks/suffix_store_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    for name in ("fill", "bounded"):
        r = out[name]
        print(f"{name}: {r['stored_tokens']} tokens in {r['docs']} docs, {r['mib_per_million_tokens']:.1f} MiB per "
              f"million tokens, add {r['add_tokens_per_s']:.0f} tok/s, lookup median {r['median_us']:.1f} us, "
              f"match rate {r['match_rate']:.2f}")
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
