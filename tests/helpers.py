"""Test helpers shared by several test modules (import with ``from tests.helpers import ...``).

* :func:`tiny_llama` (:func:`shared_tiny_llama`: built once and cached) / :func:`tiny_target`: a 4-layer random Llama (fp32, sdpa) and its
  :class:`~speculation.model.target.TargetModel` with aux layers (1, 2, 3);
* :func:`tiny_tokenizer`: a word-level tokenizer for the tiny models (saved with them);
* :func:`full_logits`: plain no-cache forward, the reference for exactness checks;
* :class:`RandomTreeDrafter`: random multi-branch trees from the drafter's own seeded RNG;
* :class:`GreedyOracleDrafter`: hides the target's greedy continuation in a random tree;
* :func:`single_thread`: run torch with one intra-op thread (much faster for toy models).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import contextlib  # noqa: E402
import functools  # noqa: E402
import random  # noqa: E402

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from speculation.drafters.base import DraftContext, Proposal, StepOutcome  # noqa: E402
from speculation.model.target import TargetModel  # noqa: E402
from speculation.spec.tree import DraftTree, NodeSource  # noqa: E402

TINY_AUX_LAYERS = (1, 2, 3)


def tiny_llama(
    vocab_size: int = 64,
    seed: int = 0,
    max_position_embeddings: int = 256,
    lm_head_scale: float = 1.0,
    tie_word_embeddings: bool = False,
    eos_token_id: int | None = None,
    lean: bool = False,
) -> LlamaForCausalLM:
    """A 4-layer randomly initialised Llama (fp32, sdpa, eval mode), deterministic in ``seed``.

    ``lm_head_scale`` multiplies the output-embedding weights (sharper, less uniform
    next-token distributions). No EOS unless ``eos_token_id`` is given. ``lean``: projections
    grouped and packed as :func:`speculation.assets.load_model` does, so a ``TargetModel`` over it
    runs the lean loop (batched verify FLAT; plain models stay PADDED).
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    if lm_head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    # No EOS unless asked for (LlamaConfig's default eos id 2 would otherwise apply).
    model.generation_config.eos_token_id = eos_token_id
    model = model.eval()
    if lean:
        from speculation.model.fused_layers import fuse_decoder
        from speculation.model.output_head import pack_linears

        fuse_decoder(model)
        pack_linears(model)
    return model


@functools.lru_cache(maxsize=8)
def shared_tiny_llama(
    vocab_size: int = 64, seed: int = 0, lm_head_scale: float = 1.0, lean: bool = False
) -> LlamaForCausalLM:
    """:func:`tiny_llama`, built once per argument set and shared (callers must not modify it)."""
    return tiny_llama(vocab_size=vocab_size, seed=seed, lm_head_scale=lm_head_scale, lean=lean)


def tiny_tokenizer(vocab_size: int = 64, eos_token: int | None = None):
    """A word-level tokenizer over ``t0 .. t{vocab_size-1}`` (id i = ``t{i}``), EOS ``t{eos_token}``
    if given: what a saved tiny model directory needs to load like a real one."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    eos = {} if eos_token is None else {"eos_token": f"t{eos_token}"}
    return PreTrainedTokenizerFast(tokenizer_object=words, **eos)


def tiny_target(model: LlamaForCausalLM | None = None, **kwargs) -> TargetModel:
    """``TargetModel`` over ``model`` (or a fresh :func:`tiny_llama`) with aux layers (1, 2, 3)."""
    if model is None:
        model = tiny_llama(**kwargs)
    return TargetModel(model, None, aux_layers=TINY_AUX_LAYERS)


@torch.inference_mode()
def full_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` logits of one plain causal forward over ``ids`` (no cache)."""
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float()


def random_tree(
    rng: random.Random,
    root_token: int,
    vocab_size: int,
    max_nodes: int = 8,
    max_siblings: int = 3,
    token_weights: list[float] | None = None,
) -> DraftTree:
    """A random draft tree of 1..``max_nodes`` non-root nodes, at most ``max_siblings`` per node.

    Sibling tokens are distinct (DraftTree merges duplicates anyway); scores decrease with depth.
    Tokens are uniform over the vocabulary, or drawn with ``token_weights`` (length vocab_size).
    """
    tree = DraftTree(root_token)
    want = rng.randint(1, max_nodes)
    attempts = 0
    while len(tree) - 1 < want and attempts < 20 * max_nodes:
        attempts += 1
        parent = rng.randrange(len(tree))
        if len(tree.children(parent)) >= max_siblings:
            continue
        if token_weights is None:
            token = rng.randrange(vocab_size)
        else:
            token = rng.choices(range(vocab_size), weights=token_weights)[0]
        if tree.child(parent, token) is not None:
            continue
        score = tree.scores[parent] - rng.uniform(0.1, 2.0)
        tree.add(parent, token, score, NodeSource.DRAFTER)
    return tree


class RandomTreeDrafter:
    """A :class:`~speculation.drafters.base.Drafter` proposing random multi-branch trees.

    Proposals depend only on the drafter's own seeded RNG (never on the target), so the candidate
    sets are fixed before the verifier draws its uniforms: exactly the setting in which lossless
    verification must reproduce the target distribution.
    """

    name = "random-tree"
    needs_aux = False
    target_topk = 0

    def __init__(
        self,
        vocab_size: int,
        seed: int = 0,
        max_nodes: int = 8,
        max_siblings: int = 3,
        token_weights: list[float] | None = None,
    ) -> None:
        if token_weights is not None and len(token_weights) != vocab_size:
            raise ValueError("token_weights must have one weight per vocabulary entry")
        self.vocab_size = vocab_size
        self.token_weights = token_weights
        self.max_nodes = max_nodes
        self.max_siblings = max_siblings
        self.rng = random.Random(seed)
        self.proposed = 0
        self.observed = 0
        self.begun = 0

    def begin(self, ctx: DraftContext, prompt_aux: torch.Tensor | None) -> None:
        self.begun += 1

    def propose(self, ctx: DraftContext) -> Proposal:
        self.proposed += 1
        tree = random_tree(
            self.rng, ctx.root_token, self.vocab_size, self.max_nodes, self.max_siblings, self.token_weights
        )
        return Proposal(tree=tree, drafter_forwards=0)

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        self.observed += 1


@contextlib.contextmanager
def single_thread():
    """Run torch with one intra-op thread, restoring the previous setting afterwards.

    On small CPU machines the multi-threaded SDPA kernel costs milliseconds per call for tiny
    shapes (thread hand-off dominates); one thread is ~100x faster for these toy models.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class GreedyOracleDrafter:
    """A drafter that knows the target's greedy continuation and hides it inside a random tree.

    Per step it computes the next ``depth`` greedy tokens of ``model`` after ``ctx.tokens`` (plain
    full forwards), optionally corrupts one of them (probability ``corrupt``), and hangs that
    chain under the root *after* a few random siblings, so accepted paths are long and their node
    indices are not ``0..m`` (the KV compaction has to move rows, not just cut).
    """

    name = "greedy-oracle"
    needs_aux = False
    target_topk = 0

    def __init__(
        self, model: LlamaForCausalLM, seed: int = 0, depth: int = 5, random_nodes: int = 6, corrupt: float = 0.3
    ) -> None:
        self.model = model
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.rng = random.Random(seed)
        self.depth = depth
        self.random_nodes = random_nodes
        self.corrupt = corrupt

    def begin(self, ctx: DraftContext, prompt_aux: torch.Tensor | None) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Proposal:
        ids = list(ctx.tokens)
        chain = []
        for _ in range(self.depth):
            nxt = int(full_logits(self.model, ids)[-1].argmax())
            chain.append(nxt)
            ids.append(nxt)
        if self.rng.random() < self.corrupt:
            k = self.rng.randrange(len(chain))
            chain[k] = (chain[k] + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
        tree = random_tree(self.rng, ctx.root_token, self.vocab_size, self.random_nodes, 3)
        scores = [-(i + 1) * 0.5 for i in range(len(chain))]
        tree.add_chain(0, chain, scores, NodeSource.DRAFTER)
        return Proposal(tree=tree, drafter_forwards=self.depth)

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        pass


def assert_lossless_on_refs(target: TargetModel, drafter, refs, max_new_tokens: int | None = None,
                            stats: dict | None = None) -> float:
    """Speculative output equals each reference token for token; returns tau (tokens per step).

    ``refs`` = (engine config, prompts, vanilla outputs), e.g. the ``spec_bench_refs`` fixture.
    ``max_new_tokens`` checks only that many tokens (greedy: a prefix of the reference).
    ``stats``, if given, receives ``steps`` and ``accepted`` (drafted tokens the target accepted), summed
    over the prompts.
    """
    import dataclasses

    from speculation.engine.solo import generate_speculative

    cfg, prompts, expected = refs
    if max_new_tokens is not None:
        cfg = dataclasses.replace(cfg, max_new_tokens=max_new_tokens)
        expected = [ref[:max_new_tokens] for ref in expected]
    gained = steps = accepted = 0
    for i, (prompt, ref) in enumerate(zip(prompts, expected)):
        res = generate_speculative(target, drafter, prompt, cfg)
        assert res.tokens == ref, f"prompt {i}: {drafter.name} output differs from vanilla"
        gained += sum(s.tokens_gained for s in res.steps)
        steps += len(res.steps)
        accepted += sum(s.accepted for s in res.steps)
    if stats is not None:
        stats.update(steps=steps, accepted=accepted)
    return gained / steps


class RecordingDrafter:
    """Wraps a drafter and keeps every proposal it makes (the engine sees the wrapped drafter)."""

    def __init__(self, inner) -> None:
        self.inner, self.proposals = inner, []
        self.name, self.needs_aux, self.target_topk = inner.name, inner.needs_aux, inner.target_topk

    def begin(self, ctx, aux) -> None:
        self.inner.begin(ctx, aux)

    def observe(self, ctx, outcome) -> None:
        self.inner.observe(ctx, outcome)

    def propose(self, ctx):
        p = self.inner.propose(ctx)
        self.proposals.append(p)
        return p


def interrupt_training(monkeypatch, trainer, at_step: int) -> None:
    """Run ``trainer`` and stop it with KeyboardInterrupt at its ``at_step``-th training step (as if
    the process were stopped there); the trainer's crash path saves its state first."""
    import pytest

    from adaptation.trainer import Trainer

    original = Trainer._train_step
    calls = {"n": 0}

    def interrupted(self, batch):
        calls["n"] += 1
        if calls["n"] == at_step:
            raise KeyboardInterrupt
        return original(self, batch)

    monkeypatch.setattr(Trainer, "_train_step", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.run()
    finally:
        monkeypatch.setattr(Trainer, "_train_step", original)
