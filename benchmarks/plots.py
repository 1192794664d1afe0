"""Plots committed next to the bench results (PNG, matplotlib, from the JSON only).

    .venv/bin/python benchmarks/plots.py benchmarks/results/eagle3_graft_specbench_bf16.json
    .venv/bin/python benchmarks/plots.py --tau-curve checkpoints/eagle3-smollm2-135m/manifest.json

For a bench JSON it writes ``<stem>_pareto.png`` (speedup against mean verified tree size, one
point per method, the Pareto front joined) and ``<stem>_acceptance.png`` (acceptance per depth
of every tree method), and, when the run had `--concurrency`, ``<stem>_concurrency.png`` (total
tokens/s against N per method). For a drafter manifest it writes ``<stem>_tau_curve.png`` under
``benchmarks/results/`` (held-out tau against training tokens). For a ``long_context`` JSON
(benchmarks/long_context.py) it writes ``<stem>_cost.png`` (c(T, L) / c(1, L) against T, one line
per context L) and ``<stem>_speedup.png`` (speedup over vanilla against prompt tokens per method).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sweeps.compare import pareto_front  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _save(fig, ax, title: str, out: Path) -> Path:
    """Title, legend, tight layout, PNG at 110 dpi; closes the figure."""
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_bench(path: Path) -> list[Path]:
    res = json.loads(path.read_text())
    methods = {n: m for n, m in res["methods"].items() if n != "vanilla" and m.get("mean_tree_size")}
    title = f"{res['model']} {res['dtype']}, {res['dataset']} ({res['n_turns']} turns x {res['max_new_tokens']} tok)"
    names = list(methods)
    pts = [(methods[n]["mean_tree_size"], methods[n]["speedup"]) for n in names]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="tab:blue")
    for n, (x, y) in zip(names, pts):
        ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = sorted(pareto_front(pts), key=lambda i: pts[i][0])
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], color="tab:red", lw=1, label="Pareto front")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="vanilla")
    ax.set_xlabel("mean verified tree size (tokens per step)")
    ax.set_ylabel("speedup over vanilla")
    pareto = _save(fig, ax, title, path.with_name(f"{path.stem}_pareto.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for n, m in methods.items():
        acc = m.get("acceptance_per_depth") or []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", ms=3, label=n)
    ax.set_xlabel("depth d")
    ax.set_ylabel("P(accepted >= d | tree reached d)")
    ax.set_ylim(0, 1)
    acceptance = _save(fig, ax, title, path.with_name(f"{path.stem}_acceptance.png"))
    written = [pareto, acceptance]
    if res.get("concurrency"):
        written.append(plot_concurrency(res, title, path.with_name(f"{path.stem}_concurrency.png")))
    return written


def plot_concurrency(res: dict, title: str, out: Path) -> Path:
    """Total output tokens/s against the number of concurrent clients, one line per method/peer;
    dashed in the same colour where the run has it: the saturated window's tokens/s (every client
    busy, before the drain)."""
    levels = sorted(res["concurrency"], key=int)
    series: dict[str, list[tuple[int, float]]] = {}
    saturated: dict[str, list[tuple[int, float]]] = {}
    for n in levels:
        level = res["concurrency"][n]
        rows = list(level["methods"].items()) + [(f"peer: {k}", v) for k, v in level.get("peers", {}).items()]
        for name, m in rows:
            series.setdefault(name, []).append((int(n), m["tokens_per_s"]))
            if m.get("saturated_tokens_per_s") is not None:
                saturated.setdefault(name, []).append((int(n), m["saturated_tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, pts in series.items():
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
        if name in saturated:
            sat = saturated[name]
            ax.plot([p[0] for p in sat], [p[1] for p in sat], marker="x", ms=4, ls="--", color=line.get_color(),
                    label=f"{name} (saturated window)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(n) for n in levels], [str(n) for n in levels])
    ax.set_xlabel("concurrent clients N")
    ax.set_ylabel("total output tokens/s")
    return _save(fig, ax, title, out)


def plot_tau_curve(manifest: Path) -> Path:
    m = json.loads(manifest.read_text())
    curve = m.get("tau_curve") or []
    if not curve:
        raise SystemExit(f"{manifest}: no tau_curve in the manifest")
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    ax.plot([c["tokens"] for c in curve], [c["tau"] for c in curve], marker="o", label="held-out tau")
    ax2 = ax.twinx()
    ax2.plot([c["tokens"] for c in curve], [c.get("acc_0") for c in curve], marker="s", color="tab:orange",
             label="held-out top-1 acc (step 0)")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("tau (tokens per step)")
    ax2.set_ylabel("top-1 accuracy")
    family = {"graftblock-specblock/1": "SpecBlock"}.get(m.get("format", ""), "EAGLE-3")
    tree = m["training"]["config"].get("eval_tree") or {}
    knobs = ", ".join(f"{k}={v}" for k, v in tree.items() if k != "slot_widths")
    ax.set_title(f"{family} for {m['target']['name']}: held-out eval tree {knobs}", fontsize=8)
    fig.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out = RESULTS / f"{manifest.parent.name}_tau_curve.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_long_context(path: Path) -> list[Path]:
    res = json.loads(path.read_text())
    title = f"{res['model']} {res['dtype']}: long context"
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for ctx, row in sorted(res.get("verify_cost", {}).items(), key=lambda kv: int(kv[0])):
        sizes = sorted(int(t) for t in row)
        ax.plot(sizes, [row[str(t)] / row["1"] for t in sizes], marker="o", ms=3, label=f"L = {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree size T (tokens verified in one forward)")
    ax.set_ylabel("c(T, L) / c(1, L)")
    cost = _save(fig, ax, title + ": relative verify cost", path.with_name(f"{path.stem}_cost.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    runs = sorted(res.get("workloads", {}).values(), key=lambda r: sum(r["prompt_tokens"]) / len(r["prompt_tokens"]))
    names = [n for n in (runs[0]["methods"] if runs else {}) if n != "vanilla"]
    xs = [sum(r["prompt_tokens"]) / len(r["prompt_tokens"]) for r in runs]
    for n in names:
        ax.plot(xs, [r["methods"][n]["speedup"] for r in runs], marker="o", label=n)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="vanilla")
    ax.set_xlabel("mean prompt tokens")
    ax.set_ylabel("speedup over vanilla (tokens/s)")
    speedup = _save(fig, ax, title + ": speedup against context", path.with_name(f"{path.stem}_speedup.png"))
    return [cost, speedup]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json", nargs="*", type=Path)
    ap.add_argument("--tau-curve", type=Path, help="a drafter checkpoint manifest.json")
    args = ap.parse_args(argv)
    written = [p for path in args.bench_json
               for p in (plot_long_context(path) if json.loads(path.read_text()).get("kind") == "long_context"
                         else plot_bench(path))]
    if args.tau_curve:
        written.append(plot_tau_curve(args.tau_curve))
    for p in written:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
