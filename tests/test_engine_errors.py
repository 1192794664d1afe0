"""Bad input gets a clear error, and bad input loses nothing.

Every invalid request or config raises a specific exception whose message names the offending
field; afterwards the same target (and drafter) still serves a valid request exactly as before.
"""

from __future__ import annotations

import functools

import pytest

from speculation.config import ConfigError, EngineConfig, RetrievalConfig, SamplingConfig, from_dict
from speculation.drafters.base import DraftContext, Proposal
from speculation.drafters.retrieval import RetrievalDrafter
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.model.target import ContextLengthError
from speculation.spec.tree import DraftTree
from tests.helpers import RandomTreeDrafter, tiny_llama, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
CONTEXT = 64
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@functools.lru_cache(maxsize=1)
def _model():
    return tiny_llama(vocab_size=VOCAB, seed=11, max_position_embeddings=CONTEXT)


def greedy(n: int = 12) -> EngineConfig:
    return EngineConfig(max_new_tokens=n, stop_at_eos=False)


def sampled(n: int = 12, seed: int = 5) -> EngineConfig:
    return EngineConfig(max_new_tokens=n, stop_at_eos=False, sampling=SamplingConfig(temperature=0.9, seed=seed))


# ---------------------------------------------------------------------------- configs
def test_engine_config_max_new_tokens():
    with pytest.raises(ConfigError, match="max_new_tokens"):
        EngineConfig(max_new_tokens=0)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        EngineConfig(max_new_tokens=-5)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        EngineConfig(max_new_tokens="5")  # type: ignore[arg-type]
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"budget": 0}, "budget"),
        ({"budget": 513}, "budget"),
        ({"transition_topk": -1}, "transition_topk"),
        ({"transition_topk": 17}, "transition_topk"),
        ({"max_match_len": 0}, "max_match_len"),
        ({"min_match_len": 5, "max_match_len": 4}, "min_match_len"),
        ({"max_depth": 0}, "max_depth"),
        ({"min_token_prob": 1.0}, "min_token_prob"),
        ({"min_token_prob": -0.1}, "min_token_prob"),
        ({"transition_topk": 2, "transition_width": 3}, "transition_width"),
        ({"datastore": "/nonexistent/datastore.npy"}, "datastore"),
    ],
)
def test_retrieval_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        RetrievalConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
    ],
)
def test_sampling_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SamplingConfig(**kwargs)


def test_valid_edge_configs_are_accepted():
    SamplingConfig(temperature=0.0, top_p=1.0, top_k=0)
    SamplingConfig(temperature=100.0, top_p=1e-6)
    RetrievalConfig(budget=1, transition_topk=0)
    RetrievalConfig(budget=512, transition_topk=16, transition_width=16)
    EngineConfig(max_new_tokens=1)


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(ConfigError, match="bugdet"):
        from_dict(RetrievalConfig, {"bugdet": 3})
    with pytest.raises(ConfigError, match="temprature"):
        from_dict(EngineConfig, {"sampling": {"temprature": 0.5}})
    # Values are validated too, naming the field.
    with pytest.raises(ConfigError, match="budget"):
        from_dict(RetrievalConfig, {"budget": 0})
    cfg = from_dict(EngineConfig, {"max_new_tokens": 7, "sampling": {"temperature": 0.5, "top_p": 0.8}})
    assert cfg.max_new_tokens == 7 and cfg.sampling == SamplingConfig(temperature=0.5, top_p=0.8)


# ---------------------------------------------------------------------------- requests
@pytest.mark.parametrize("loop", ["vanilla", "speculative"])
def test_empty_prompt(loop):
    target = tiny_target(_model())
    with pytest.raises(ValueError, match="empty"):
        if loop == "vanilla":
            generate_vanilla(target, [], greedy())
        else:
            generate_speculative(target, RandomTreeDrafter(VOCAB), [], greedy())


def test_empty_prompt_at_the_target():
    target = tiny_target(_model())
    with pytest.raises(ValueError, match="empty"):
        target.prefill([])
    with pytest.raises(ValueError, match="empty"):
        target.check_fits(0, 1)


@pytest.mark.parametrize("loop", ["vanilla", "speculative"])
def test_prompt_longer_than_context(loop):
    target = tiny_target(_model())
    assert target.max_context == CONTEXT
    too_long = [1] * (CONTEXT + 1)
    with pytest.raises(ContextLengthError, match="context"):
        if loop == "vanilla":
            generate_vanilla(target, too_long, greedy(1))
        else:
            generate_speculative(target, RandomTreeDrafter(VOCAB), too_long, greedy(1))


def test_prompt_plus_new_tokens_must_fit():
    target = tiny_target(_model())
    with pytest.raises(ContextLengthError, match="max_new_tokens"):
        generate_vanilla(target, [1] * 60, greedy(5))
    assert issubclass(ContextLengthError, ValueError)
    # Exactly at the limit is fine.
    assert len(generate_vanilla(target, [1] * 60, greedy(4)).tokens) == 4
    assert len(generate_speculative(target, RandomTreeDrafter(VOCAB), [1] * 60, greedy(4)).tokens) == 4


class _FailingDrafter:
    """Raises in ``propose`` on the first call: a drafter crash mid-request."""

    name = "failing"
    needs_aux = False
    target_topk = 0

    def __init__(self) -> None:
        self.calls = 0

    def begin(self, ctx: DraftContext, prompt_aux) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Proposal:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("drafter exploded")
        return Proposal(tree=DraftTree(ctx.root_token))

    def observe(self, ctx, outcome) -> None:
        pass


def test_bad_input_loses_nothing():
    """After each kind of rejected request the same target and drafter serve valid ones exactly."""
    target = tiny_target(_model())
    drafter = RetrievalDrafter(RetrievalConfig(budget=8, cost_aware=False), VOCAB)
    ref_greedy = generate_vanilla(target, PROMPT, greedy()).tokens
    ref_sampled = generate_vanilla(target, PROMPT, sampled()).tokens
    assert generate_speculative(target, drafter, PROMPT, greedy()).tokens == ref_greedy

    bad_requests = [
        (ValueError, lambda: generate_vanilla(target, [], greedy())),
        (ValueError, lambda: generate_speculative(target, drafter, [], greedy())),
        (ContextLengthError, lambda: generate_vanilla(target, [1] * (CONTEXT + 1), greedy())),
        (ContextLengthError, lambda: generate_speculative(target, drafter, [1] * (CONTEXT + 1), greedy())),
        (ContextLengthError, lambda: generate_speculative(target, drafter, PROMPT, greedy(CONTEXT))),
        (RuntimeError, lambda: generate_speculative(target, _FailingDrafter(), PROMPT, greedy())),
    ]
    for exc, request in bad_requests:
        with pytest.raises(exc):
            request()
        assert generate_vanilla(target, PROMPT, greedy()).tokens == ref_greedy
        assert generate_vanilla(target, PROMPT, sampled()).tokens == ref_sampled
        assert generate_speculative(target, drafter, PROMPT, greedy()).tokens == ref_greedy

    # A drafter that failed once keeps working (its next request proposes root-only trees).
    flaky = _FailingDrafter()
    with pytest.raises(RuntimeError):
        generate_speculative(target, flaky, PROMPT, greedy())
    assert generate_speculative(target, flaky, PROMPT, greedy()).tokens == ref_greedy


def test_dtype_parse_accepts_members_aliases_and_rejects_others():
    from speculation.config import BenchConfig, DType

    assert DType.parse(DType.BFLOAT16) is DType.BFLOAT16
    assert DType.parse("fp32") is DType.FLOAT32
    assert BenchConfig().dtype is DType.BFLOAT16
    with pytest.raises(ConfigError, match="dtype"):
        DType.parse("float16")


def test_generation_releases_the_sequence_even_when_a_step_fails():
    """Both loops release the target's sequence (its KV cache) when generation ends, normally or not."""
    from speculation.model.target import ReleasedSequenceError

    target = tiny_target(_model())
    released = []
    release = target.release

    def spy(state) -> None:
        released.append(state)
        release(state)

    target.release = spy  # type: ignore[method-assign]
    generate_vanilla(target, PROMPT, greedy())
    generate_speculative(target, RetrievalDrafter(RetrievalConfig(budget=8, cost_aware=False), VOCAB), PROMPT, greedy())
    assert len(released) == 2 and all(s.cache is None for s in released)
    with pytest.raises(ReleasedSequenceError, match="released"):
        target.decode(released[0], 1)

    class Failing(RetrievalDrafter):
        def propose(self, ctx):
            raise RuntimeError("drafter broke")

    with pytest.raises(RuntimeError, match="drafter broke"):
        generate_speculative(target, Failing(RetrievalConfig(cost_aware=False), VOCAB), PROMPT, greedy())
    assert len(released) == 3 and released[-1].cache is None
