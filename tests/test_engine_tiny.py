"""End-to-end decode loops on a tiny random Llama: greedy exactness and output truncation.

Greedy (T = 0), fp32: speculative decoding must reproduce vanilla decoding token for token,
whatever the drafter proposes (random trees, retrieval, or an oracle that makes long, non-
contiguous accepted paths). With ``stop_at_eos`` both loops stop at the first EOS (kept), and
a step that accepts past EOS or past ``max_new_tokens`` is truncated there.
"""

from __future__ import annotations


import pytest

from speculation.config import EngineConfig, RetrievalConfig, SamplingConfig
from speculation.policy.cost import VerifyCostModel
from speculation.drafters.base import DraftContext, Drafter
from speculation.drafters.retrieval import RetrievalDrafter
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.model.target import TargetModel
from tests.helpers import GreedyOracleDrafter, RandomTreeDrafter, shared_tiny_llama, tiny_llama, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
NEW = 40
PROMPTS = [
    [5],
    [1, 2, 3, 4, 5, 6, 7, 8],
    [10, 20, 10, 20, 10, 20, 10],
    [63, 0, 17, 42, 42, 42, 9, 31, 8, 8, 1, 60, 2],
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
]


def _model():
    return shared_tiny_llama(vocab_size=VOCAB, seed=42)


def greedy_cfg(n: int = NEW, stop_at_eos: bool = False) -> EngineConfig:
    return EngineConfig(max_new_tokens=n, stop_at_eos=stop_at_eos, sampling=SamplingConfig(temperature=0.0))


DRAFTERS = {
    "random-tree": lambda model: RandomTreeDrafter(VOCAB, seed=3),
    "retrieval": lambda model: RetrievalDrafter(RetrievalConfig(budget=8, cost_aware=False), VOCAB),
    # Default knobs, cost-aware: trees cut by a verify curve that makes mid-size trees pay off.
    "retrieval-default": lambda model: RetrievalDrafter(
        RetrievalConfig(), VOCAB, VerifyCostModel.from_curve({1: 1.0, 4: 1.1, 8: 1.6, 25: 4.0})
    ),
    "oracle": lambda model: GreedyOracleDrafter(model, seed=5),
}


def check_steps(res, n_tokens: int) -> None:
    assert sum(s.tokens_gained for s in res.steps) + 1 == n_tokens  # +1: the prefill token
    for s in res.steps:
        assert s.tree_size == s.drafted + 1
        assert 0 <= s.accepted <= s.drafted
        assert 1 <= s.tokens_gained <= s.accepted + 1
        assert sum(s.accepted_by_source.values()) == s.accepted
        assert sum(s.drafted_by_source.values()) == s.drafted


@pytest.mark.parametrize("drafter_name", list(DRAFTERS))
def test_greedy_speculative_equals_vanilla(drafter_name):
    model = _model()
    target = tiny_target(model)
    drafter = DRAFTERS[drafter_name](model)
    assert isinstance(drafter, Drafter)
    total_accepted = 0
    for prompt in PROMPTS:
        ref = generate_vanilla(target, prompt, greedy_cfg()).tokens
        assert len(ref) == NEW
        res = generate_speculative(target, drafter, prompt, greedy_cfg())
        assert res.tokens == ref, f"{drafter_name} diverged from vanilla on prompt {prompt}"
        check_steps(res, NEW)
        total_accepted += sum(s.accepted for s in res.steps)
    if drafter_name == "oracle":
        # Long accepted paths: far fewer verify steps than tokens.
        assert total_accepted >= NEW * len(PROMPTS) // 2
    if drafter_name.startswith("retrieval"):
        assert total_accepted > 0, "retrieval never hit: the test would not exercise acceptance"


def test_random_tree_drafter_satisfies_protocol_and_is_deterministic():
    a, b = RandomTreeDrafter(VOCAB, seed=9), RandomTreeDrafter(VOCAB, seed=9)
    ctx = DraftContext(tokens=[1, 2, 3], prompt_len=3)
    for _ in range(20):
        ta, tb = a.propose(ctx).tree, b.propose(ctx).tree
        assert ta.tokens == tb.tokens and ta.parents == tb.parents
        assert ta.root_token == 3
        assert 2 <= len(ta) <= 9
        assert all(len(ta.children(i)) <= 3 for i in range(len(ta)))


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_max_new_tokens_truncates_accepted_paths(n):
    model = _model()
    target = tiny_target(model)
    for prompt in PROMPTS[:3]:
        ref = generate_vanilla(target, prompt, greedy_cfg(NEW)).tokens
        res = generate_speculative(target, GreedyOracleDrafter(model, seed=1, corrupt=0.0), prompt, greedy_cfg(n))
        assert res.tokens == ref[:n]
        assert generate_vanilla(target, prompt, greedy_cfg(n)).tokens == ref[:n]


def _eos_case(model) -> tuple[list[int], int, int]:
    """(prompt, eos token, index of its first occurrence) with the EOS well inside the output."""
    target = TargetModel(model, None, aux_layers=(1, 2, 3))
    for prompt in PROMPTS:
        out = generate_vanilla(target, prompt, greedy_cfg()).tokens
        for j in range(3, NEW - 5):
            if out[j] not in out[:j]:
                return prompt, out[j], j
    pytest.skip("no token makes a usable EOS for this model")


@pytest.mark.parametrize("drafter_name", list(DRAFTERS))
def test_stop_at_eos_truncates_at_first_eos(drafter_name):
    model = tiny_llama(vocab_size=VOCAB, seed=42)  # own copy: the EOS setting must not leak
    prompt, eos, j = _eos_case(model)
    full = generate_vanilla(tiny_target(model), prompt, greedy_cfg()).tokens
    model.generation_config.eos_token_id = eos
    target = tiny_target(model)
    assert target.eos_token_ids == frozenset({eos})

    van = generate_vanilla(target, prompt, greedy_cfg(stop_at_eos=True)).tokens
    assert van == full[: j + 1] and van[-1] == eos

    res = generate_speculative(target, DRAFTERS[drafter_name](model), prompt, greedy_cfg(stop_at_eos=True))
    assert res.tokens == full[: j + 1]
    check_steps(res, j + 1)

    # stop_at_eos=False ignores EOS in both loops.
    assert generate_vanilla(target, prompt, greedy_cfg()).tokens == full
    assert generate_speculative(target, DRAFTERS[drafter_name](model), prompt, greedy_cfg()).tokens == full


def test_eos_inside_an_accepted_path_is_truncated_mid_step():
    """The oracle accepts several tokens per step, so EOS lands mid-path; the rest is dropped."""
    model = tiny_llama(vocab_size=VOCAB, seed=42)
    prompt, eos, j = _eos_case(model)
    full = generate_vanilla(tiny_target(model), prompt, greedy_cfg()).tokens
    model.generation_config.eos_token_id = [eos]  # list form, as many checkpoints store it
    target = tiny_target(model)
    res = generate_speculative(target, GreedyOracleDrafter(model, seed=2, depth=8, corrupt=0.0), prompt,
                               greedy_cfg(stop_at_eos=True))
    assert res.tokens == full[: j + 1]
    last = res.steps[-1]
    assert last.tokens_gained < last.accepted + 1, "EOS did not land inside an accepted path"


def test_bench_records_the_report_of_reportable_drafters_only():
    """run_bench stores ``drafter_report`` for a drafter implementing Reportable with something to
    report, nothing for others (a retrieval drafter without a store reports {})."""
    from speculation import assets
    from speculation.bench.runner import run_bench
    from speculation.config import BenchConfig
    from speculation.drafters import Reportable
    from tests.helpers import tiny_tokenizer

    class ReportingRetrieval(RetrievalDrafter):
        def report(self) -> dict:
            return {"budget_rule": "fixed", "budget": self.config.budget}

    fixed = RetrievalConfig(budget=8, cost_aware=False)
    assert isinstance(ReportingRetrieval(fixed, VOCAB), Reportable)
    assert RetrievalDrafter(fixed, VOCAB).report() == {}
    assert not isinstance(RandomTreeDrafter(VOCAB), Reportable)
    target = TargetModel(_model(), tiny_tokenizer(VOCAB), aux_layers=(1, 2, 3))

    def parts(spec):
        cls = ReportingRetrieval if spec.name == "reporting" else RetrievalDrafter
        return target, cls(spec.config, VOCAB)

    cfg = BenchConfig(methods=("reporting", "plain"), model="tiny", dtype="float32", warmup=0, max_new_tokens=8)
    methods = {"reporting": {"type": "retrieval", "budget": 8, "cost_aware": False},
               "plain": {"type": "retrieval", "budget": 8, "cost_aware": False}}
    out = run_bench(cfg, target, [assets.Question("q0", "cat", ("t1 t2 t3",))], methods, method_parts=parts)
    assert out["methods"]["reporting"]["drafter_report"] == {"budget_rule": "fixed", "budget": 8}
    assert "drafter_report" not in out["methods"]["plain"]
    assert out["methods"]["reporting"]["lossless"] is True


def test_the_solo_loop_prices_every_verify_into_a_measured_curve():
    """Each solo step reports (tree size, context, verify seconds) to a drafter whose c(T) was
    measured, and the corrected curve is what the next tree is cut by; output stays exact."""
    import dataclasses

    from speculation.policy.cost import OnlineCostModel

    model = _model()
    target = tiny_target(model)
    measured = dataclasses.replace(VerifyCostModel.from_curve({1: 1.0, 4: 1.1, 8: 1.6, 25: 4.0}), measured=True)
    drafter = RetrievalDrafter(RetrievalConfig(), VOCAB, measured)
    assert isinstance(drafter.cost_model, OnlineCostModel)
    seen: list[tuple[int, int, float]] = []
    observe = drafter.cost_model.observe
    drafter.cost_model.observe = lambda size, ctx, sec: (seen.append((size, ctx, sec)), observe(size, ctx, sec))
    prompt = PROMPTS[2]
    res = generate_speculative(target, drafter, prompt, greedy_cfg())
    assert res.tokens == generate_vanilla(target, prompt, greedy_cfg()).tokens
    assert [s for s, _, _ in seen] == [s.tree_size for s in res.steps]
    assert [sec for _, _, sec in seen] == [s.verify_s for s in res.steps]
    committed = len(prompt) + 1  # prefill token
    for (_, ctx, _), step in zip(seen, res.steps):
        assert ctx == committed
        committed += step.tokens_gained
    # Live steps on the tiny model take milliseconds against a curve in seconds: every ratio is
    # clipped to 1/4 and the sizes the loop verified were corrected toward it.
    assert drafter.cost_model.observed == len(res.steps)
    assert min(drafter.cost_model.factors) < 1.0


def test_bench_prefills_in_chunks_when_asked_and_stays_lossless():
    """``run_bench(prefill_chunk_tokens=k)``: every method's prompt goes through the target in
    forwards of at most k tokens (long documents), outputs still token-identical to vanilla."""
    from speculation import assets
    from speculation.bench.runner import run_bench
    from speculation.config import BenchConfig
    from tests.helpers import tiny_tokenizer

    target = TargetModel(_model(), tiny_tokenizer(VOCAB), aux_layers=(1, 2, 3))
    seen: list[int | None] = []
    real_prefill = target.prefill

    def recording_prefill(ids, *a, chunk_tokens=None, **k):
        seen.append(chunk_tokens)
        return real_prefill(ids, *a, chunk_tokens=chunk_tokens, **k)

    target.prefill = recording_prefill
    cfg = BenchConfig(methods=("retrieval",), model="tiny", dtype="float32", warmup=0, max_new_tokens=8)
    question = assets.Question("q0", "cat", (" ".join(f"t{i % 50}" for i in range(40)),))
    out = run_bench(cfg, target, [question], {"retrieval": {"budget": 8, "cost_aware": False}},
                    prefill_chunk_tokens=5)
    assert out["prefill_chunk_tokens"] == 5 and seen and set(seen) == {5}
    assert out["methods"]["retrieval"]["lossless"] is True
