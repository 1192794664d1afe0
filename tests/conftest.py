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


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module with one torch intra-op thread (tiny models are much faster that way).

    Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    from tests.helpers import single_thread

    with single_thread():
        yield


# ---------------------------------------------------------------------- real SmolLM2 (slow tests)
SPEC_BENCH_NEW_TOKENS = 64
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
    chat-templated, with their vanilla greedy fp32 continuations of 64 tokens."""
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
