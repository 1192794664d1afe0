"""Statistical losslessness of speculative sampling (docs/algorithms.md §2b, §2c).

Setup. A tiny random Llama (vocabulary 10, fixed seed) whose lm_head is scaled up (x15) so that,
after temperature 0.8 and top-p 0.9, the next-token distributions range from flat (max prob
~0.26) to peaky (max prob ~0.76) and top-p truncation is active. Enumerating every continuation
with plain full forwards and :func:`speculation.spec.verify.target_probs` gives the EXACT
distribution ``p*`` of the first ``K = 3`` generated tokens (about 120 sequences have mass).

Each decoding loop under test (vanilla; speculative with random multi-branch trees; speculative
with the retrieval drafter; with a random EAGLE-3 head; with a random SpecBlock head; with Graft over
each of them) draws ``N = 2000`` independent 3-token continuations of one prompt, every sample with its
own ``SamplingConfig.seed``.

* Null hypothesis H0: the samples are i.i.d. draws from ``p*`` (the loop is lossless).
* Statistic: Pearson's chi-square ``X^2 = sum_c (O_c - E_c)^2 / E_c`` over the cells of ``p*``
  with ``E_c = N p*(c)``; cells with ``E_c < 5`` are pooled into one cell (merged with the
  smallest regular cell if the pool itself is below 5). ``df = cells - 1``; the p-value is the
  chi-square survival function ``Q(df/2, X^2/2)`` (regularised upper incomplete gamma,
  ``torch.special.gammaincc``; scipy is not needed). A sample outside the support of ``p*``
  fails the test outright.
* Significance level: alpha = 1e-3; H0 is rejected when p < alpha.

False failures. Under H0 a correct implementation fails one such test with probability alpha
(1 in 1000) over the choice of seeds. The seeds are fixed (model, drafters, every sample's
sampling seed), so the outcome is deterministic run to run: a passing test stays passing until
the code changes what is sampled, and a failure is reproducible (look at it, do not re-run it).

Negative control. A goodness-of-fit test that never fails proves nothing: with too few samples,
too much pooling, or a bug in the statistic it would pass any sampler. So the same test, with
the same N, model and drafter, is run against a deliberately broken acceptance rule (accept a
candidate when ``U <= min(1, 2 P(x))``, which over-samples drafted tokens) and must REJECT it
(p < alpha). That shows the test has the power to detect a realistic verification bug at this N.

Runtime: 10-30 s per loop (N = 2000) on 2 CPU cores; about 35 s for the loops of the fast tier,
about 165 s for the module.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter

import pytest
import torch

from speculation.spec import verify as V
from speculation.config import (
    Eagle3Config,
    EngineConfig,
    GraftConfig,
    RetrievalConfig,
    SamplingConfig,
    SpecBlockConfig,
)
from speculation.drafters.eagle3 import build_eagle3_drafter
from speculation.drafters.retrieval import RetrievalDrafter
from speculation.drafters.specblock import build_specblock_drafter
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.policy.cost import VerifyCostModel
from speculation.drafters.graft import build_graft_drafter
from speculation.spec.tree import ROOT, DraftTree
from tests.helpers import RandomTreeDrafter, RecordingDrafter, full_logits, shared_tiny_llama, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 10
K = 3  # generated tokens per sample
N = 2000  # samples per loop under test (~15 s per loop on 2 CPU cores)
ALPHA = 1e-3
LM_HEAD_SCALE = 15.0  # the default init (std 0.02) gives near-uniform logits; x15 mixes flat and peaky
PROMPT = [1, 2, 3, 4, 1, 2, 3]
SAMPLING = SamplingConfig(temperature=0.8, top_p=0.9)


def _model():
    return shared_tiny_llama(vocab_size=VOCAB, seed=0, lm_head_scale=LM_HEAD_SCALE)


@functools.lru_cache(maxsize=2)
def exact_distribution(sampling: SamplingConfig = SAMPLING) -> dict[tuple[int, ...], float]:
    """``p*``: probability of every K-token continuation of PROMPT under ``sampling``, by exhaustive
    enumeration."""
    procs = V.build_processors(sampling)
    model = _model()
    dist: dict[tuple[int, ...], float] = {}

    def expand(seq: list[int], prob: float) -> None:
        if len(seq) == len(PROMPT) + K:
            dist[tuple(seq[len(PROMPT) :])] = prob
            return
        p = V.target_probs(full_logits(model, seq)[-1:], procs)[0].double()
        for tok in range(VOCAB):
            if p[tok] > 0:
                expand(seq + [tok], prob * float(p[tok]))

    expand(list(PROMPT), 1.0)
    return dist


def draft_weights() -> list[float]:
    """Token weights of the random-tree drafter: the target's unigram frequencies under p*, floored.

    Real drafters propose likely tokens; so does this one (trees are still random, and chosen
    from the drafter's own RNG, independently of the verifier's uniforms). With uniform draft
    tokens most proposals are rejected, and the bias of a broken acceptance rule largely averages
    out over random candidate sets (the negative control then only reached p ~ 0.03 at N = 3000).
    """
    freq = [0.0] * VOCAB
    for seq, prob in exact_distribution().items():
        for tok in seq:
            freq[tok] += prob / K
    return [f + 0.02 for f in freq]


# ---------------------------------------------------------------------------- the statistic
def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution: Q(df/2, x/2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(x / 2.0, dtype=torch.float64)))


def chi_square_gof(counts: Counter, dist: dict[tuple[int, ...], float], n: int) -> tuple[float, int, float]:
    """Pearson chi-square of ``counts`` (n samples) against ``dist``, pooling cells with E < 5.

    Returns (statistic, degrees of freedom, p-value).
    """
    cells = sorted(dist, key=lambda c: dist[c])  # ascending expected count
    bins: list[tuple[float, int]] = []  # (expected, observed)
    pool_e, pool_o = 0.0, 0
    for c in cells:
        e = n * dist[c]
        if e < 5.0:
            pool_e += e
            pool_o += counts.get(c, 0)
        else:
            bins.append((e, counts.get(c, 0)))
    if pool_e > 0.0:
        if pool_e < 5.0 and bins:  # too small on its own: merge with the smallest regular cell
            e, o = bins.pop(0)
            pool_e, pool_o = pool_e + e, pool_o + o
        bins.append((pool_e, pool_o))
    stat = sum((o - e) ** 2 / e for e, o in bins)
    df = len(bins) - 1
    return stat, df, chi2_sf(stat, df)


def run_test(sample_fn, n: int = N) -> tuple[float, int, float, Counter]:
    """Draw ``n`` K-token samples with ``sample_fn(seed)`` and test them against ``p*``."""
    dist = exact_distribution()
    counts: Counter = Counter()
    for seed in range(n):
        toks = tuple(sample_fn(seed))
        assert len(toks) == K
        counts[toks] += 1
    outside = {c: k for c, k in counts.items() if c not in dist}
    assert not outside, f"sampled continuations the target gives probability 0: {outside}"
    stat, df, p = chi_square_gof(counts, dist, n)
    return stat, df, p, counts


def engine_cfg(seed: int) -> EngineConfig:
    return EngineConfig(
        max_new_tokens=K,
        stop_at_eos=False,
        sampling=SamplingConfig(temperature=SAMPLING.temperature, top_p=SAMPLING.top_p, seed=seed),
    )


# ---------------------------------------------------------------------------- checks of the checker
def test_exact_distribution_is_a_nontrivial_distribution():
    dist = exact_distribution()
    assert math.isclose(sum(dist.values()), 1.0, abs_tol=1e-5)  # fp32 softmax
    assert 30 <= len(dist) < VOCAB**K  # top-p truncates, but many sequences remain
    probs = sorted(dist.values(), reverse=True)
    assert probs[0] > 5 * probs[len(probs) // 2]  # far from uniform


def test_chi2_sf_matches_known_values():
    # Reference quantiles of the chi-square distribution.
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(10.827566170662733, 1) == pytest.approx(0.001, abs=1e-9)
    assert chi2_sf(2.0 * 10, 20) == pytest.approx(0.45792971447185, abs=1e-9)
    assert chi2_sf(149.44925277903857, 100) == pytest.approx(0.001, abs=1e-7)
    assert chi2_sf(0.0, 5) == pytest.approx(1.0)


def test_chi_square_on_exact_multinomial_draws_passes():
    """Sampling straight from p* with torch passes; sampling from a distorted p* fails."""
    dist = exact_distribution()
    cells = list(dist)
    probs = torch.tensor([dist[c] for c in cells], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(probs, N, replacement=True, generator=gen).tolist()
    _, _, p = chi_square_gof(Counter(cells[i] for i in draws), dist, N)
    assert p >= ALPHA
    distorted = probs**1.3
    distorted /= distorted.sum()
    draws = torch.multinomial(distorted, N, replacement=True, generator=gen).tolist()
    _, _, p = chi_square_gof(Counter(cells[i] for i in draws), dist, N)
    assert p < ALPHA


# ---------------------------------------------------------------------------- the loops
def test_vanilla_sampling_matches_exact_distribution():
    target = tiny_target(_model())
    stat, df, p, _ = run_test(lambda seed: generate_vanilla(target, PROMPT, engine_cfg(seed)).tokens)
    print(f"vanilla: X^2={stat:.1f}, df={df}, p={p:.3g}")
    assert p >= ALPHA, f"vanilla: X^2={stat:.1f}, df={df}, p={p:.2e}"


def _random_tree_drafter(target):
    return RandomTreeDrafter(VOCAB, seed=7, max_nodes=8, max_siblings=3, token_weights=draft_weights())


def _retrieval_drafter(target):
    return RetrievalDrafter(RetrievalConfig(budget=8, cost_aware=False), VOCAB)


def _eagle3_drafter(target):
    """A random-init EAGLE-3 head: its candidates are deterministic top-k given the context, i.e.
    fixed before the verifier's uniforms are drawn, the condition under which section 2b is exact."""
    cfg = Eagle3Config(checkpoint="random", draft_vocab_size=VOCAB, top_k=3, depth=2, total_tokens=10)
    return build_eagle3_drafter(cfg, target)


GRAFT_CURVE = VerifyCostModel((1, 16, 128), (1.0, 2.5, 13.7))
"""A fixed c(T) (seconds, 0.1 s per node) for the Graft loops: the drafter gate and the automatic K_max
then decide from the observed acceptance (seeded, so reproducible), not from this host's timing noise
(the measured drafting time d, ~1 ms here, is negligible against it)."""
GRAFT_EAGLE3 = {"type": "eagle3", "top_k": 3, "checkpoint": "random", "draft_vocab_size": VOCAB}
GRAFT_SPECBLOCK = {"type": "specblock", "checkpoint": "random", "draft_vocab_size": VOCAB, "block_size": 2, "beam": 3,
                   "slot_widths": (2, 2, 3, 0), "adaptive_widths": False}


def _graft_drafter(target):
    """Graft over a random EAGLE-3 head, with settings that mix all three stages (0 by the drafter
    gate, 1, 3) and leave free slots to graft into, at the root and under anchors (checked by
    test_graft_settings_mix_every_stage_and_graft)."""
    cfg = GraftConfig(tree_drafter=GRAFT_EAGLE3, stages=(0, 1, 3), threshold=0.8, dense_budget=10, graft_budget=4,
                      stage_budgets=(0, 3, 7), gate_warmup=2)
    return build_graft_drafter(cfg, target, GRAFT_CURVE)


def _graft_specblock_drafter(target):
    """Graft over a random SpecBlock head (K = 2, rank head on, give-up stops chains): stage 0, one
    block, two blocks, with free slots to graft into. The cost cut is off here (the EAGLE-3 loops
    run with it): on this curve it removes every anchored graft under the random head's nodes, and
    this loop is the one that samples through anchored grafts over SpecBlock."""
    cfg = GraftConfig(tree_drafter=GRAFT_SPECBLOCK, stages=(0, 2, 4), threshold=1.0, dense_budget=10,
                      graft_budget=4, stage_budgets=(0, 4, 7), gate_warmup=2, cost_cut=False)
    return build_graft_drafter(cfg, target, GRAFT_CURVE)


def _graft_auto_drafter(target):
    """Graft over a random EAGLE-3 head with ``dense_budget: 0``: K_max chosen every step from c(T),
    the rank posterior and the measured drafting time."""
    cfg = GraftConfig(tree_drafter=GRAFT_EAGLE3, stages=(0, 1, 3), threshold=0.8, dense_budget=0, graft_budget=4,
                      gate_warmup=2)
    return build_graft_drafter(cfg, target, GRAFT_CURVE)


def _graft_specblock_auto_drafter(target):
    """Graft over a random SpecBlock head with ``dense_budget: 0`` (cost cut off, as above)."""
    cfg = GraftConfig(tree_drafter=GRAFT_SPECBLOCK, stages=(0, 2, 4), threshold=1.0, dense_budget=0, graft_budget=4,
                      gate_warmup=2, cost_cut=False)
    return build_graft_drafter(cfg, target, GRAFT_CURVE)


def _specblock_drafter(target):
    """A random-init SpecBlock head with its rank head on and two blocks (branching and inheritance)."""
    cfg = SpecBlockConfig(checkpoint="random", draft_vocab_size=VOCAB, block_size=3, max_blocks=2, beam=3,
                          slot_widths=(2, 2, 3, 1), total_tokens=10, adaptive_widths=False)
    return build_specblock_drafter(cfg, target)


# Every tree drafter on main is listed here; a new drafter adds its factory. The fast tier
# (`make test-fast`) samples vanilla, the Graft (EAGLE-3) loop (retrieved and drafted nodes) and the
# negative control here, and random trees inside a batch (tests/test_batching.py); the other loops
# (10-30 s each at N = 2000) run in `make test`.
FAST_LOOPS = {"graft"}
DRAFTERS = {
    "random_tree": _random_tree_drafter,
    "retrieval": _retrieval_drafter,
    "eagle3": _eagle3_drafter,
    "graft": _graft_drafter,
    "specblock": _specblock_drafter,
    "graft_specblock": _graft_specblock_drafter,
    "graft_auto": _graft_auto_drafter,
    "graft_specblock_auto": _graft_specblock_auto_drafter,
}
GRAFT_LOOPS = ["graft", "graft_specblock", "graft_auto", "graft_specblock_auto"]


@pytest.mark.parametrize("name", [n if n in FAST_LOOPS else pytest.param(n, marks=pytest.mark.slow) for n in DRAFTERS])
def test_speculative_sampling_is_lossless(name):
    target = tiny_target(_model())
    drafter = DRAFTERS[name](target)
    accepted = []

    def sample(seed: int) -> list[int]:
        res = generate_speculative(target, drafter, PROMPT, engine_cfg(seed))
        accepted.extend(s.accepted for s in res.steps)
        return res.tokens

    stat, df, p, _ = run_test(sample)
    print(f"{name} speculative: X^2={stat:.1f}, df={df}, p={p:.3g}, accepted={sum(accepted)}")
    assert p >= ALPHA, f"{name} speculative: X^2={stat:.1f}, df={df}, p={p:.2e}"
    assert sum(accepted) > N // 4, f"{name}: drafts were (almost) never accepted: the test exercised nothing"


@pytest.mark.parametrize("name", GRAFT_LOOPS)
def test_graft_settings_mix_every_stage_and_graft(name):
    """The Graft loops above test what they claim: every stage occurs (counted), retrieved nodes are
    grafted at the root and under drafter anchors, and an automatic K_max varies."""
    target = tiny_target(_model())
    drafter = RecordingDrafter(DRAFTERS[name](target))
    for seed in range(40):
        generate_speculative(target, drafter, PROMPT, engine_cfg(seed))
    counts = Counter(p.stats["stage"] for p in drafter.proposals)
    assert set(counts) == {float(s) for s in drafter.inner.config.stages}, counts
    assert all(n >= 2 for n in counts.values()), counts
    assert any(p.stats["grafted"] > 0 for p in drafter.proposals)
    assert drafter.inner.counters["grafted_anchored"] > 0  # under drafter nodes, not only at the root
    if drafter.inner.config.cost_cut:  # the cost cut removed nodes in some steps (and sampling stayed exact)
        assert any(p.stats["cost_cut"] > 0 for p in drafter.proposals)
    if drafter.inner.config.dense_budget == 0:
        assert len({p.stats["k_max"] for p in drafter.proposals}) > 1


SAMPLING_TOP_K = SamplingConfig(temperature=0.9, top_k=4)


@pytest.mark.slow  # 10 s each at N = 2000; the fast tier samples Graft with top-p above
@pytest.mark.parametrize("name", ["graft_auto", "graft_specblock_auto"])
def test_graft_top_k_sampling_is_lossless(name):
    """Top-k sampling (the loops above use temperature + top-p): Graft's samples follow p*."""
    dist = exact_distribution(SAMPLING_TOP_K)
    assert len({s[0] for s in dist}) <= 4 and len(dist) <= 4**K  # top-k really truncates
    target = tiny_target(_model())
    drafter = DRAFTERS[name](target)
    counts: Counter = Counter()
    accepted = 0
    for seed in range(N):
        cfg = EngineConfig(max_new_tokens=K, stop_at_eos=False, sampling=dataclasses.replace(SAMPLING_TOP_K, seed=seed))
        res = generate_speculative(target, drafter, PROMPT, cfg)
        accepted += sum(s.accepted for s in res.steps)
        counts[tuple(res.tokens)] += 1
    outside = {c: k for c, k in counts.items() if c not in dist}
    assert not outside, f"sampled continuations top-k gives probability 0: {outside}"
    stat, df, p = chi_square_gof(counts, dist, N)
    print(f"{name} top-k: X^2={stat:.1f}, df={df}, p={p:.3g}, accepted={accepted}")
    assert p >= ALPHA, f"{name} top-k: X^2={stat:.1f}, df={df}, p={p:.2e}"
    assert accepted > N // 4, f"{name}: drafts were (almost) never accepted under top-k"


def _broken_sample(tree: DraftTree, logits: torch.Tensor, processors, generator: torch.Generator) -> V.VerifyResult:
    """A WRONG acceptance rule: accept candidate x when U <= min(1, 2 P(x)) (over-accepts drafts)."""
    cur = ROOT
    accepted = [ROOT]
    while True:
        probs = V.target_probs(logits[cur : cur + 1], processors)[0]
        moved = False
        for child in tree.children(cur):
            x = tree.tokens[child]
            u = float(torch.rand((), generator=generator))
            if probs[x] > 0 and u <= min(1.0, 2.0 * float(probs[x])):
                accepted.append(child)
                cur = child
                moved = True
                break
            probs[x] = 0.0
            if float(probs.sum()) <= 0.0:
                break
            probs = probs / probs.sum()
        if not moved:
            bonus = int(torch.multinomial(probs, 1, generator=generator))
            return V.VerifyResult(accepted=accepted, bonus_token=bonus)


def test_negative_control_broken_acceptance_is_rejected(monkeypatch):
    """The same test at the same N must detect a biased acceptance rule (it has power)."""
    monkeypatch.setattr(V, "sample", _broken_sample)
    target = tiny_target(_model())
    drafter = RandomTreeDrafter(VOCAB, seed=7, max_nodes=8, max_siblings=3, token_weights=draft_weights())
    stat, df, p, _ = run_test(lambda seed: generate_speculative(target, drafter, PROMPT, engine_cfg(seed)).tokens)
    print(f"negative control: X^2={stat:.1f}, df={df}, p={p:.3g}")
    assert p < ALPHA, f"broken acceptance was NOT detected: X^2={stat:.1f}, df={df}, p={p:.2e}"
