"""Which online-update knobs raise a served head's held-out tau: a grid over the learning rate, the
share of accepted positions kept in the loss, the optimizer steps and the train-set size, on the
feedback of one stream phase.

    .venv/bin/python benchmarks/online_knobs.py --drafter eagle3 --phase code --requests 24 --heldout 6 \
        --lrs 3e-4,3e-5 --keeps 0.25,1.0 --steps 32,128 --train-requests 6,18 \
        --json benchmarks/results/online_knobs_eagle3_code_fp32.json

Serves ``--requests`` questions of one phase of ``--stream`` greedily with the live head, every
verify step's feedback going into a :class:`~adaptation.feedback.ReplayBuffer` (the same records
adapt-bench's learner sees); the last ``--heldout`` requests are held out. Then, for every grid
point, :class:`~adaptation.online.OnlineUpdater` trains a candidate from the live weights on the
first ``n`` train requests and :mod:`adaptation.gain` replays it against the live weights, paired,
on the held-out requests (tau with its bootstrap interval) and on the train requests it saw (tau
on the trained text: how far the candidate fits what it was trained on). Nothing here measures
speed; the figure is tau, as the learner's gate estimates it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from pathlib import Path

import torch

from adaptation.feedback import BufferConfig, FeedbackSink, ReplayBuffer
from adaptation.gain import ReplayConfig, estimate_gain, replay_units, replica, tau_of
from adaptation.online import OnlineConfig, OnlineUpdater
from graftblock.adapt import StreamSpec, _encode, stream_questions
from speculation.bench.runner import emit_json, environment
from speculation.config import EngineConfig, SamplingConfig
from speculation.drafters import build_drafter, resolve_methods
from speculation.engine.solo import generate_speculative
from speculation.model.target import load_target


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default="eagle3", choices=["eagle3", "specblock"])
    ap.add_argument("--stream", default="ray_configs/stream_domain_shift.yaml")
    ap.add_argument("--phase", default="code", help="the stream phase whose questions are served")
    ap.add_argument("--requests", type=int, default=24, help="requests served (train + held-out)")
    ap.add_argument("--heldout", type=int, default=6, help="most recent requests held out")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lrs", type=_floats, default=[3e-4, 3e-5])
    ap.add_argument("--keeps", type=_floats, default=[0.25, 1.0], help="accepted_keep values")
    ap.add_argument("--steps", type=_ints, default=[32, 128], help="optimizer steps per candidate")
    ap.add_argument("--train-requests", type=_ints, default=[0], help="train requests used (0 = all)")
    ap.add_argument("--chunk", type=int, default=32, help="replay unit, positions")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    if args.heldout >= args.requests:
        raise SystemExit(f"--heldout {args.heldout} must be below --requests {args.requests}")
    torch.set_num_threads(args.threads)
    spec = StreamSpec.from_yaml(args.stream)
    phases = [p for p in spec.phases if p.name == args.phase]
    if not phases:
        raise SystemExit(f"--phase {args.phase!r} not in {args.stream} (it has {[p.name for p in spec.phases]})")
    stream = dataclasses.replace(spec, phases=(dataclasses.replace(phases[0], requests=args.requests),))
    target = load_target(args.model, args.dtype)
    prompts = [ids for _, ids in _encode(target.tokenizer, stream_questions(stream), 0)]
    drafter = build_drafter(resolve_methods([args.drafter], {})[0], target)

    buffer = ReplayBuffer(BufferConfig(max_records=1 << 20, heldout_sequences=args.heldout))
    sink = FeedbackSink(buffer.add)
    cfg = EngineConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=True, sampling=SamplingConfig(temperature=0.0))
    t0 = time.perf_counter()
    live_steps = live_gained = 0
    for i, p in enumerate(prompts):
        res = generate_speculative(target, drafter, p, cfg, feedback=sink.hook(i))
        sink.drain()
        sink.end_request(i)
        live_steps += len(res.steps)
        live_gained += sum(s.tokens_gained for s in res.steps)
        print(f"[serve {i + 1}/{len(prompts)}] tau {sum(s.tokens_gained for s in res.steps) / len(res.steps):.2f}",
              flush=True)
    serve_s = time.perf_counter() - t0
    train_all, held = buffer.train_sequences(), buffer.heldout_sequences()
    base = {k: v.detach().float().clone() for k, v in drafter.state_dict().items()}
    twin = replica(drafter)
    replay_cfg = ReplayConfig(chunk=args.chunk)
    old_held = replay_units(twin, held, args.chunk)
    print(f"live tau {live_gained / live_steps:.3f}; held-out replay tau {tau_of(old_held):.3f} "
          f"({len(train_all)} train / {len(held)} held-out requests)", flush=True)

    rows = []
    sizes = [n or len(train_all) for n in args.train_requests]
    if max(sizes) > len(train_all):
        raise SystemExit(f"--train-requests {max(sizes)} exceeds the {len(train_all)} train requests served")
    old_train_by_n = {n: replay_units(twin, train_all[:n], args.chunk) for n in sizes}
    for n, lr, keep, steps in itertools.product(sizes, args.lrs, args.keeps, args.steps):
        train = train_all[:n]
        old_train = old_train_by_n[n]
        updater = OnlineUpdater(drafter, OnlineConfig(lr=lr, accepted_keep=keep))
        t1 = time.perf_counter()
        result = updater.train(base, train, steps)
        train_s = time.perf_counter() - t1
        cand = replica(drafter, result.state)
        new_held = replay_units(cand, held, args.chunk)
        new_train = replay_units(cand, train, args.chunk)
        est = estimate_gain(old_held, new_held, 1.0, 1.0, replay_cfg)
        row = {
            "train_requests": n, "train_positions": sum(s.length for s in train), "lr": lr,
            "accepted_keep": keep, "steps": steps, "mean_loss": result.mean_loss, "train_s": train_s,
            "tau_heldout_old": est.tau_old, "tau_heldout_new": est.tau_new,
            "tau_heldout_new_ci": [est.tau_new_lo, est.tau_new_hi],
            "heldout_gain_per_token_ci": [est.gain_lo_s, est.gain_hi_s],
            "tau_train_old": tau_of(old_train), "tau_train_new": tau_of(new_train),
        }
        rows.append(row)
        print(f"n={n} lr={lr:g} keep={keep:g} steps={steps}: held-out tau {est.tau_old:.3f} -> {est.tau_new:.3f} "
              f"[{est.tau_new_lo:.3f}, {est.tau_new_hi:.3f}]  train tau {row['tau_train_old']:.3f} -> "
              f"{row['tau_train_new']:.3f}  loss {result.mean_loss:.3f}  {train_s:.0f} s", flush=True)

    out = {
        "kind": "online_knobs",
        "command": " ".join(["benchmarks/online_knobs.py", *(argv if argv is not None else sys.argv[1:])]),
        "env": environment(), "model": args.model, "dtype": args.dtype, "drafter": args.drafter,
        "stream": args.stream, "phase": args.phase, "requests": args.requests, "heldout": args.heldout,
        "max_new_tokens": args.max_new_tokens, "chunk": args.chunk, "serve_s": serve_s,
        "live_tau": live_gained / live_steps, "heldout_units": len(old_held), "rows": rows,
    }
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
