"""Shared pytest setup: keep Hugging Face offline and make the repo importable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

# ---------------------------------------------------------------------- test tiers
# `make test-fast` sets GRAFTBLOCK_TEST_TIER=fast and runs `-m "not slow"`: no real model weights, no Ray.
FAST_TIER = os.environ.get("GRAFTBLOCK_TEST_TIER") == "fast"

SLOW_FIXTURES = frozenset({
    "smol_fp32",  # SmolLM2-135M's real weights
    "spec_bench_refs",  # ... and its greedy continuations
    "smollm2",  # tests/test_assets.py: the same weights
    "ray_local",  # a local Ray cluster
    "tiny_model_dir",  # a saved model that whole commands (adapt-bench, serve, shard actors) load and run
    "local_cluster",  # a multi-node Ray cluster started with `ray start` (tests/test_multinode_*.py)
    "serve_subprocess",  # a `graftblock serve` process: Ray Serve in a child the fast-tier guard cannot see
})
"""A test that uses one of these (directly or through another fixture) is marked ``slow``."""


@pytest.fixture(scope="session")
def serve_subprocess():
    """Requested by the fixtures that start `graftblock serve` as a child process: the child starts
    Ray, which the in-process guard below cannot intercept, so using one marks the test ``slow``."""
    return None


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())) and "slow" not in item.keywords:
            item.add_marker(slow)


class FastTierViolation(AssertionError):
    """A test outside the ``slow`` marker loaded real weights or started Ray in the fast tier."""


def _is_real_model(name) -> bool:
    """A packaged alias, a hub id or a directory in the asset cache: real weights (a tmp dir is a tiny model)."""
    from speculation.assets import MODEL_ALIASES, cache_dir

    location = getattr(name, "location", name)
    if str(getattr(name, "name", name)) in MODEL_ALIASES:
        return True
    if str(location) in MODEL_ALIASES:
        return True
    try:
        return Path(str(location)).expanduser().resolve().is_relative_to(cache_dir().resolve())
    except OSError:
        return False


@pytest.fixture(autouse=True)
def _fast_tier_guard(request, monkeypatch):
    """In the fast tier, loading real weights or starting Ray fails the test: mark it ``slow``."""
    if not FAST_TIER:
        yield
        return
    import ray

    import speculation.assets as assets_pkg
    from speculation.assets import models

    real_load = models.load_model

    def guarded_load(name, *a, **k):
        if _is_real_model(name):
            raise FastTierViolation(f"{request.node.nodeid} loads real weights ({name}); mark it slow")
        return real_load(name, *a, **k)

    def no_ray(*a, **k):
        raise FastTierViolation(f"{request.node.nodeid} starts Ray; mark it slow")

    def no_convert(spec, *a, **k):
        raise FastTierViolation(f"{request.node.nodeid} converts {spec.alias}'s weights; run `make assets` first")

    monkeypatch.setattr(models, "load_model", guarded_load)
    monkeypatch.setattr(models, "_convert", no_convert)
    monkeypatch.setattr(assets_pkg, "load_model", guarded_load)
    monkeypatch.setattr(ray, "init", no_ray)
    yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module with one torch intra-op thread (tiny models are much faster that way).

    Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    from tests.helpers import single_thread

    with single_thread():
        yield


# ---------------------------------------------------------------------- real SmolLM2 (slow tests)
SPEC_BENCH_NEW_TOKENS = 48
"""The longest prefix a test checks (tests/test_graft_real.py): vanilla tokens past it cost ~47 ms each
on 2 cores and were never compared."""
SPEC_BENCH_PROMPTS = 8
_MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@pytest.fixture(scope="session")
def smol_fp32():
    """SmolLM2-135M-Instruct in fp32, loaded once per session."""
    import torch

    from speculation import assets
    from speculation.model.target import TargetModel

    model, tok = assets.load_model_and_tokenizer("smollm2-135m", torch.float32)
    return TargetModel(model, tok)


@pytest.fixture(scope="session")
def spec_bench_refs(smol_fp32):
    """Eight Spec-Bench first turns (the 5 non-MT-bench categories first, then MT-bench ones),
    chat-templated, with their vanilla greedy fp32 continuations of ``SPEC_BENCH_NEW_TOKENS`` tokens."""
    from speculation import assets
    from speculation.config import EngineConfig, SamplingConfig
    from speculation.engine.solo import generate_vanilla

    questions = assets.load_questions("spec_bench", limit_per_category=1)  # packaged with the code
    questions = sorted(questions, key=lambda q: q.category in _MT_BENCH)
    prompts = [assets.encode_turn(smol_fp32.tokenizer, [], q.turns[0]) for q in questions[:SPEC_BENCH_PROMPTS]]
    assert len(prompts) == SPEC_BENCH_PROMPTS
    greedy = EngineConfig(max_new_tokens=SPEC_BENCH_NEW_TOKENS, stop_at_eos=True,
                          sampling=SamplingConfig(temperature=0.0))
    return greedy, prompts, [generate_vanilla(smol_fp32, p, greedy).tokens for p in prompts]
