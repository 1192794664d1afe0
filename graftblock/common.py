"""What the sub-command modules share: the common flags, ``--config`` YAML, the default result path
and the one-line user-error handling. ``graftblock.cli`` assembles the sub-commands from here and
from their modules; nothing here (nor in any other module but ``__main__``) imports ``graftblock.cli``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import yaml
from ray.exceptions import RayError, RayTaskError

import tracking
from speculation.assets import AssetError
from speculation.config import ConfigError, load_yaml_mapping
from sweeps.lease import StudyBusy

RUNS_DIR = Path("runs")
"""Where a result JSON goes when no ``--json`` is given (git-ignored)."""

MAX_THREADS = 256
"""Upper end of ``--threads`` (the same bound as ``bench.threads``)."""

USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, AssetError, tracking.TrackingError, StudyBusy,
               yaml.YAMLError)
"""What a sub-command raises for a user's mistake: one line on stderr, exit status 2."""


def load_yaml(path: str | None) -> dict:
    """The ``--config`` YAML (method name -> options), ``{}`` without one."""
    return load_yaml_mapping(path, "--config", "method name -> options") if path else {}


def add_model_args(p: argparse.ArgumentParser, dtype_help: str = "bfloat16 | float32 (default bfloat16)") -> None:
    p.add_argument("--model", default="smollm2-135m", help="packaged alias, HF id or local dir")
    p.add_argument("--dtype", default=None, help=dtype_help)
    p.add_argument("--threads", type=int, default=None, help=f"torch threads, 1..{MAX_THREADS} (default: torch's)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="run every target product in row groups within its kernel's probed invariant limit, "
                        "so batched output equals solo bit for bit also where the CPU's kernels switch with "
                        "the row count (bf16 on AMX hosts); costs the large kernels' speed (in-process target only)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; range [0, 100]")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, range (0, 1] (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens, >= 0 (0 = off)")
    p.add_argument("--seed", type=int, default=0)


def add_tracking_args(p: argparse.ArgumentParser, experiment: str = "graftblock-bench") -> None:
    p.add_argument("--no-mlflow", action="store_true", help="do not log this run to MLflow")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--experiment", default=experiment, help="MLflow experiment name")


def add_json_arg(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("--json", default=None, metavar="PATH",
                   help=f"where to write the result JSON (default: {RUNS_DIR}/{command}-<UTC time>.json)")


def json_path(args: argparse.Namespace, command: str) -> Path:
    """``--json``, or ``runs/<command>-<UTC timestamp>.json``; its folder is created."""
    if args.json:
        out = Path(args.json)
    else:
        out = RUNS_DIR / f"{command}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def check_threads(args: argparse.Namespace) -> int | None:
    """``--threads`` in [1, MAX_THREADS] (checked before torch sees it), or None."""
    n = getattr(args, "threads", None)
    if n is not None and not 1 <= n <= MAX_THREADS:
        raise ConfigError(f"--threads must be in [1, {MAX_THREADS}], got {n}")
    return n


_CONFIG_KEY = re.compile(r"\b(?:bench|sampling|engine|batch)\.([a-z_]+)\b")


def flag_names(message: str, parser: argparse.ArgumentParser | None) -> str:
    """``bench.max_new_tokens must ...`` -> ``--max-new-tokens must ...`` where ``parser`` has that flag,
    so an error from a flag's value names the flag the user typed, not the config key behind it."""
    if parser is None:
        return message
    flags = {s for a in parser._actions for s in a.option_strings}

    def sub(m: re.Match) -> str:
        flag = "--" + m.group(1).replace("_", "-")
        return flag if flag in flags else m.group(0)

    return _CONFIG_KEY.sub(sub, message)


def one_line(exc: BaseException) -> str:
    """A user-facing one-line message: a Ray task error shows its cause, whitespace is folded."""
    if isinstance(exc, RayTaskError):
        exc = exc.cause
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Run ``args.func``; user errors are one line on stderr and exit status 2 (no traceback).
    With ``parser`` (the sub-command's, for commands whose values come from flags) config keys in
    the message become the flags they came from."""
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"graftblock {args.command}: error: {flag_names(' '.join(str(exc).split()), parser)}", file=sys.stderr)
        return 2
    except RayError as exc:  # an actor died or a remote task raised: say why, in one line
        print(f"graftblock {args.command}: error: {type(exc).__name__}: {one_line(exc)}", file=sys.stderr)
        return 2
