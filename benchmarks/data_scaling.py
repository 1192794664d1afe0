"""Drafter training-scale curves: held-out tau and acceptance per position against training tokens,
one curve per training run (e.g. raw ShareGPT answers against the target's own, distilled ones).

    python -m benchmarks.data_scaling --run raw=runs/scale-eagle3-raw \
        --run distilled=runs/scale-eagle3-distilled --json benchmarks/results/data_scaling_eagle3_bf16.json

Each ``--run LABEL=DIR`` names a ``graftblock train`` workdir (its ``final/manifest.json``) or a
manifest file. The manifest's ``tau_curve`` holds the trainer's evaluations: real greedy
speculative decoding of the held-out ShareGPT prompts (never trained on, not in Spec-Bench) at
``tokens`` trained tokens. Written per run:

* the curve: tokens, tau, ``accept_ge_j`` (share of verify steps accepting at least j drafted
  tokens), the wall seconds so far;
* a fit ``tau = a + b * log2(tokens)`` over the points with tokens > 0 (least squares), and from
  it the tokens, and the CPU-hours, to reach tau 2.5 and 3.0. CPU-hours are at the run's training
  rate: tokens / (wall seconds - the seconds its tau evaluations took), so feature extraction is
  included and the evaluations, which a longer run need not repeat as often, are not (the
  end-to-end figure is recorded beside it). Each point's evaluation seconds come from its
  ``tau_curve`` entry or, for runs that predate that field, the checkpoint the trainer saved at
  that point (``heldout.tau_eval_s``). Extrapolating a log-linear fit far beyond its points is a
  guess, and the JSON says which range it was fitted on;
* for every other run, tau at the tokens both runs evaluated (the ratio at equal training tokens,
  which is equal compute: the same network, loss and batch plan per token).

Where the run's feature cache is still on disk (``--features`` of its command, else
``DIR/features``), its size is recorded: bytes and tokens over the ``shard_*.safetensors`` files
(tokens = rows of their ``input_ids``), and bytes per million tokens.

A PNG of tau against tokens (log scale) goes beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib
import numpy as np

from safetensors import safe_open

from speculation.bench.runner import environment

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

TAU_TARGETS = (2.5, 3.0)
"""The tau levels the extrapolation is asked for."""


def load_manifest(where: str) -> dict:
    """A run's final manifest: ``DIR/final/manifest.json``, ``DIR/manifest.json`` or the file itself."""
    p = Path(where)
    for cand in (p / "final" / "manifest.json", p / "manifest.json", p):
        if cand.is_file():
            return json.loads(cand.read_text())
    raise SystemExit(f"data_scaling: no manifest at {where} (looked for final/manifest.json, manifest.json)")


def fit_log_tokens(tokens: list[int], taus: list[float]) -> dict | None:
    """``tau = a + b * log2(tokens)`` by least squares over points with tokens > 0 (None under 2 points)."""
    pts = [(t, y) for t, y in zip(tokens, taus) if t > 0 and y is not None]
    if len(pts) < 2:
        return None
    x = np.log2([t for t, _ in pts])
    y = np.array([v for _, v in pts])
    b, a = np.polyfit(x, y, 1)
    resid = y - (a + b * x)
    return {"a": float(a), "b_per_doubling": float(b), "points": len(pts),
            "fitted_tokens": [int(pts[0][0]), int(pts[-1][0])], "rmse": float(np.sqrt(np.mean(resid ** 2)))}


def command_option(manifest: dict, name: str) -> str | None:
    """``--name VALUE`` of the command that trained the run (recorded in its manifest), or None."""
    words = (manifest.get("command") or "").split()
    for i, w in enumerate(words[:-1]):
        if w == name:
            return words[i + 1]
    return None


def feature_cache(where: Path | None) -> dict | None:
    """Size of a feature cache directory: bytes, tokens and bytes per million tokens over its
    ``shard_*.safetensors`` (the held-out shard included); None when it is not there."""
    if where is None or not (where / "meta.json").is_file():
        return None
    shards = sorted(where.glob("shard_*.safetensors"))
    tokens = 0
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            tokens += f.get_slice("input_ids").get_shape()[0]
    size = sum(s.stat().st_size for s in shards)
    return {"dir": str(where), "shards": len(shards), "bytes": size, "tokens": tokens,
            "bytes_per_million_tokens": size / tokens * 1e6 if tokens else None}


def _checkpoint_eval_s(workdir: Path | None, tokens: int) -> float | None:
    """``heldout.tau_eval_s`` of the checkpoint the trainer saved at ``tokens`` (None if absent)."""
    if workdir is None:
        return None
    path = workdir / "checkpoints" / f"tokens_{tokens:010d}" / "manifest.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("heldout", {}).get("heldout.tau_eval_s")


def curve_of(label: str, manifest: dict, workdir: Path | None = None) -> dict:
    """One run's curve, fit and extrapolation (see the module docstring)."""
    tr = manifest["training"]
    points = [{"tokens": int(p["tokens"]), "tau": p.get("tau"), "accept_ge": p.get("accept_ge"),
               "elapsed_s": p.get("elapsed_s"),
               "eval_s": p.get("eval_s", _checkpoint_eval_s(workdir, int(p["tokens"])))}
              for p in manifest.get("tau_curve", [])]
    wall = tr.get("wall_s")
    end_to_end = tr["tokens"] / wall if wall else None  # tokens per wall second, evaluations included
    eval_s = sum(p["eval_s"] for p in points) if points and all(p["eval_s"] is not None for p in points) else None
    training = tr["tokens"] / (wall - eval_s) if wall and eval_s is not None and wall > eval_s else None
    rate, basis = (training, "training") if training else (end_to_end, "end_to_end")
    fit = fit_log_tokens([p["tokens"] for p in points], [p["tau"] for p in points])
    reach = {}
    for target in TAU_TARGETS:
        if fit is None or fit["b_per_doubling"] <= 0:
            reach[str(target)] = None
            continue
        tokens = 2.0 ** ((target - fit["a"]) / fit["b_per_doubling"])
        reach[str(target)] = {"tokens": tokens, "cpu_hours": tokens / rate / 3600 if rate else None}
    return {"label": label, "data": manifest["data"].get("source"),
            "distilled_new_tokens": manifest["data"].get("distilled_new_tokens"),
            "tokens": tr["tokens"], "wall_s": tr["wall_s"], "tokens_per_s": rate,
            "tokens_per_s_end_to_end": end_to_end, "rate_basis": basis, "eval_s": eval_s, "feature_extract_s": tr.get("feature_extract_s"),
            "threads": command_option(manifest, "--threads"), "dtype": command_option(manifest, "--dtype"),
            "command": manifest.get("command"), "config": tr["config"], "points": points,
            "fit": fit, "reach": reach, "feature_cache": feature_cache(_features_dir(manifest, workdir))}


def _features_dir(manifest: dict, workdir: Path | None) -> Path | None:
    named = command_option(manifest, "--features")
    if named:
        return Path(named)
    return workdir / "features" if workdir is not None else None


def equal_tokens(curves: list[dict]) -> list[dict]:
    """tau of every pair of runs at the token counts both evaluated."""
    out = []
    for i, a in enumerate(curves):
        for b in curves[i + 1:]:
            at_a = {p["tokens"]: p["tau"] for p in a["points"]}
            for p in b["points"]:
                if p["tokens"] in at_a and p["tokens"] > 0 and at_a[p["tokens"]] and p["tau"]:
                    out.append({"tokens": p["tokens"], a["label"]: at_a[p["tokens"]], b["label"]: p["tau"],
                                "ratio": p["tau"] / at_a[p["tokens"]], "of": f"{b['label']} / {a['label']}"})
    return out


def nearest_pairs(curves: list[dict]) -> list[dict]:
    """Where the runs' eval points differ slightly (batches end at different token counts), pair
    each point of the first run with the other run's point nearest in tokens (within 5%)."""
    out = []
    if len(curves) < 2:
        return out
    a, b = curves[0], curves[1]
    for p in a["points"]:
        if p["tokens"] <= 0 or p["tau"] is None:
            continue
        q = min((q for q in b["points"] if q["tokens"] > 0 and q["tau"] is not None),
                key=lambda q: abs(q["tokens"] - p["tokens"]), default=None)
        if q is not None and abs(q["tokens"] - p["tokens"]) <= 0.05 * p["tokens"]:
            out.append({"tokens": p["tokens"], "tokens_other": q["tokens"], a["label"]: p["tau"],
                        b["label"]: q["tau"], "ratio": q["tau"] / p["tau"], "of": f"{b['label']} / {a['label']}"})
    return out


def plot(curves: list[dict], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for c in curves:
        pts = [p for p in c["points"] if p["tokens"] > 0 and p["tau"] is not None]
        ax.plot([p["tokens"] for p in pts], [p["tau"] for p in pts], marker="o", label=c["label"])
        if c["fit"]:
            f = c["fit"]
            xs = np.geomspace(f["fitted_tokens"][0], f["fitted_tokens"][1] * 4, 50)
            ax.plot(xs, f["a"] + f["b_per_doubling"] * np.log2(xs), linestyle=":", color=ax.lines[-1].get_color())
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out tau (tokens per verify step)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("Held-out tau against training tokens (dotted: log-linear fit, x4 beyond)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/data_scaling.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="LABEL=DIR",
                   help="a training run: label and workdir (or manifest); repeat for each curve")
    p.add_argument("--family", default="eagle3", help="the drafter family the runs trained (recorded)")
    p.add_argument("--json", required=True, help="where to write the result")
    args = p.parse_args(argv)
    runs = []
    for spec in args.run:
        label, sep, where = spec.partition("=")
        if not sep or not label or not where:
            raise SystemExit(f"data_scaling: --run must be LABEL=DIR, got {spec!r}")
        runs.append((label, load_manifest(where), Path(where) if Path(where).is_dir() else None))
    curves = [curve_of(label, m, workdir) for label, m, workdir in runs]
    dtypes = {c["dtype"] for c in curves}
    out = Path(args.json)
    env = environment()  # the host the runs trained on: run this script where they ran
    env["torch_threads"] = ",".join(sorted({str(c["threads"]) for c in curves}))  # the training runs' threads
    cmd = sys.argv[1:] if argv is None else argv
    res = {"kind": "data_scaling", "command": " ".join(["python -m benchmarks.data_scaling", *cmd]),
           "env": env, "family": args.family, "model": runs[0][1]["target"]["name"],
           "dtype": ",".join(sorted(str(d) for d in dtypes)), "eval": runs[0][1]["training"]["config"],
           "curves": curves, "equal_tokens": equal_tokens(curves) or nearest_pairs(curves),
           "tau_targets": list(TAU_TARGETS)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
                   + "\n")
    png = plot(curves, out.with_name(f"{out.stem}_tau.png"))
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
