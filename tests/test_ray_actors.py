"""The decode loop over Ray actors equals the single-process engine, token for token.

Real Ray (one local cluster per session, 2 CPUs), real actors: sharded target
(:class:`~workers.shard.TargetShard`) and drafter worker, driven by the unchanged
``speculation.engine`` loops through ``RayTargetBackend`` / ``RayDrafterProxy``.

* tiny random Llama (fp32, 1 and 2 shards): retrieval drafter (fixed and cost-aware trees),
  a random EAGLE-3 head (aux hidden states from the shards),
  vanilla, aux hidden states, KV compaction with moved rows (an oracle drafter), weight swaps;
* real SmolLM2-135M (fp32, 2 shards, 2 prompts, 32 tokens; retrieval and the trained EAGLE-3
  checkpoint): marked ``slow``;
* bad input: more shards than layers, more resources than the cluster has.

Runtime: ~40 s for the tiny tests, ~30 s more for SmolLM2 (2 CPUs).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from cluster.deploy import ClusterResourceError, RayDeployment
from cluster.topology import Topology
from speculation.config import ConfigError, EngineConfig
from speculation.drafters import build_drafter, resolve_methods
from speculation.engine.solo import generate_speculative, generate_vanilla
from tests.helpers import TINY_AUX_LAYERS, GreedyOracleDrafter, single_thread, tiny_target
from tests.ray_fixtures import ray_local, tiny_model_dir  # noqa: F401  (fixtures)
from workers.drafter_worker import WeightsNotSupportedError

ENGINE = EngineConfig(max_new_tokens=40)
TOPO = dict(shard_resources={"CPU": 0.25}, drafter_resources={"CPU": 0.25}, ready_timeout_s=30)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Repetitive prompts so the retrieval drafter proposes real trees.
    return [[rng.randrange(64) for _ in range(8)] * 3 for _ in range(3)]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):  # noqa: F811
    """The single-process twin, loaded as the shard actors load it (``assets.load_model``)."""
    from speculation import assets

    model = assets.load_model(str(tiny_model_dir), torch.float32)
    model.generation_config.eos_token_id = None
    return tiny_target(model)


@pytest.fixture(scope="module")
def deployments(ray_local, tiny_model_dir):  # noqa: F811
    """Tiny-model deployments with 1 and 2 shards, shared by this module's tests."""
    deps = {
        n: RayDeployment(
            Topology(shards=n, **TOPO), str(tiny_model_dir), "float32", aux_layers=TINY_AUX_LAYERS
        )
        for n in (1, 2)
    }
    yield deps
    for dep in deps.values():
        dep.shutdown()


@pytest.mark.parametrize("n_shards", [1, 2])
def test_tiny_ray_equals_single_process(deployments, tiny, n_shards):
    fixed = resolve_methods(["retrieval"], {"retrieval": {"cost_aware": False, "budget": 8}})[0]
    costed = resolve_methods(["retrieval"], {"retrieval": {"budget": 8}})[0]
    dep = deployments[n_shards]
    with single_thread():
        for prompt in _prompts(n_shards):
            ref = generate_speculative(tiny, build_drafter(fixed, tiny), prompt, ENGINE)
            got = generate_speculative(dep.backend, dep.drafter(fixed), prompt, ENGINE)
            assert got.tokens == ref.tokens
            # Same trees, same acceptance: the loop itself is shared, not re-implemented.
            assert [(s.tree_size, s.accepted) for s in got.steps] == [
                (s.tree_size, s.accepted) for s in ref.steps
            ]
            vanilla = generate_vanilla(tiny, prompt, ENGINE).tokens
            assert generate_vanilla(dep.backend, prompt, ENGINE).tokens == vanilla == ref.tokens
            # Cost-aware trees depend on timings measured over the actors; output must not.
            assert generate_speculative(dep.backend, dep.drafter(costed), prompt, ENGINE).tokens == vanilla


def test_finished_sequences_are_released_on_every_shard(deployments, tiny):
    """Generation (and the c(T) measurement) release their sequences: afterwards no shard holds
    one, where before only the LRU bound (topology.max_sequences) ever freed them."""
    import ray

    dep = deployments[2]
    spec = resolve_methods(["retrieval"], {"retrieval": {"cost_aware": False, "budget": 8}})[0]
    with single_thread():
        prompt = _prompts(5)[0]
        state, _, _ = dep.backend.prefill(prompt)
        live = ray.get([s.sequences.remote() for s in dep.shards])
        assert all(state.seq_id in seqs for seqs in live)  # the query sees live sequences
        dep.backend.release(state)
        generate_vanilla(dep.backend, prompt, ENGINE)
        generate_speculative(dep.backend, dep.drafter(spec), prompt, ENGINE)
        dep.drafter(resolve_methods(["retrieval"], {"retrieval": {"budget": 4}})[0])  # measures c(T)
    assert ray.get([s.sequences.remote() for s in dep.shards]) == [[], []]
    dep.backend.sync()  # the release calls themselves succeeded


FEATURE_DRAFTERS = {
    "eagle3": {"checkpoint": "random", "draft_vocab_size": 48, "total_tokens": 12, "depth": 3, "top_k": 3},
    "specblock": {"checkpoint": "random", "draft_vocab_size": 48, "total_tokens": 12, "beam": 3, "block_size": 3},
}


@pytest.mark.parametrize("method", sorted(FEATURE_DRAFTERS))
@pytest.mark.parametrize("n_shards", [1, 2])
def test_tiny_ray_feature_drafters_equal_single_process(deployments, tiny, n_shards, method):
    """Feature drafters (random EAGLE-3 and SpecBlock heads) read aux hidden states gathered from
    the shards."""
    spec = resolve_methods([method], {method: FEATURE_DRAFTERS[method]})[0]
    dep = deployments[n_shards]
    with single_thread():
        for prompt in _prompts(n_shards + 10):
            ref = generate_speculative(tiny, build_drafter(spec, tiny), prompt, ENGINE)
            got = generate_speculative(dep.backend, dep.host_drafter(method, build_drafter(spec, tiny)), prompt,
                                       ENGINE)
            assert got.tokens == ref.tokens == generate_vanilla(tiny, prompt, ENGINE).tokens
            assert [(s.tree_size, s.accepted) for s in got.steps] == [(s.tree_size, s.accepted) for s in ref.steps]


def test_tiny_ray_aux_and_moved_kv_rows(deployments, tiny_model_dir, tiny):  # noqa: F811
    dep = deployments[2]
    with single_thread():
        prompt = _prompts(7)[0]
        s1, l1, a1 = tiny.prefill(prompt, need_aux=True)
        s2, l2, a2 = dep.backend.prefill(prompt, need_aux=True)
        assert torch.equal(l1, l2) and torch.equal(a1, a2)
        # The oracle hides the greedy path behind random siblings: accepted rows are not 0..m.
        ref = generate_speculative(tiny, _Oracle(str(tiny_model_dir)), prompt, ENGINE)
        proxy = dep.host_drafter("oracle", _Oracle(str(tiny_model_dir)))
        got = generate_speculative(dep.backend, proxy, prompt, ENGINE)
        assert got.tokens == ref.tokens == generate_vanilla(tiny, prompt, ENGINE).tokens
        assert sum(s.accepted for s in got.steps) > 10


class _Oracle(GreedyOracleDrafter):
    """The greedy oracle over the saved tiny model; pickles as (dir, seed) and reloads there."""

    def __init__(self, model_dir: str, seed: int = 3) -> None:
        from transformers import AutoModelForCausalLM

        self.model_dir, self.seed = model_dir, seed
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        super().__init__(model.eval(), seed=seed, corrupt=0.3)

    def __reduce__(self):
        return (_Oracle, (self.model_dir, self.seed))


class _LinearDrafter:
    """A drafter with weights (a WeightSwappable): proposes argmax(W[root]) as a single child."""

    name = "linear"
    needs_aux = False
    target_topk = 0

    def __init__(self, vocab: int) -> None:
        self.w = torch.nn.Linear(vocab, vocab, bias=False)
        torch.nn.init.zeros_(self.w.weight)

    def state_dict(self):
        return self.w.state_dict()

    def load_state_dict(self, state):
        self.w.load_state_dict(state)

    def begin(self, ctx, prompt_aux):
        pass

    def propose(self, ctx):
        from speculation.drafters.base import Proposal
        from speculation.spec.tree import DraftTree, NodeSource

        tree = DraftTree(ctx.root_token)
        tree.add(0, int(self.w.weight[:, ctx.root_token].argmax()), -1.0, NodeSource.DRAFTER)
        return Proposal(tree=tree, drafter_forwards=1)

    def observe(self, ctx, outcome):
        pass


def test_drafter_worker_swaps_weights_between_steps(deployments):
    import ray

    dep = deployments[1]
    proxy = dep.host_drafter("linear", _LinearDrafter(64))
    assert proxy.traits.has_weights
    from speculation.drafters.base import DraftContext

    ctx = DraftContext(tokens=[1, 2, 5], prompt_len=3)
    proxy.begin(ctx, None)
    assert proxy.propose(ctx).tree.tokens == [5, 0]
    w = torch.zeros(64, 64)
    w[42, 5] = 1.0
    assert proxy.swap_weights(ray.put({"weight": w})) == 1
    assert proxy.propose(ctx).tree.tokens == [5, 42]
    retrieval = dep.drafter(resolve_methods(["retrieval"], {"retrieval": {"cost_aware": False}})[0])
    assert not retrieval.traits.has_weights
    with pytest.raises(WeightsNotSupportedError, match="no weights to swap"):
        retrieval.swap_weights(ray.put({}))  # Ray re-raises the actor's error as its own type


def test_more_shards_than_layers_fails_before_any_actor(ray_local, tiny_model_dir):  # noqa: F811
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"topology.shards = 5 exceeds the target's 4 layers"):
        RayDeployment(Topology(shards=5, **TOPO), str(tiny_model_dir), "float32")
    assert time.monotonic() - t0 < 10


def test_resources_the_cluster_lacks_fail_fast(ray_local, tiny_model_dir):  # noqa: F811
    t0 = time.monotonic()
    with pytest.raises(ClusterResourceError, match=r"asks for GPU: 2 in total .* cluster has GPU: 0"):
        RayDeployment(
            Topology(shards=2, shard_resources={"GPU": 1}, drafter_resources={"CPU": 0.1}),
            str(tiny_model_dir),
            "float32",
        )
    with pytest.raises(ClusterResourceError, match=r"asks for CPU: 3.1 in total .* cluster has CPU: 2"):
        RayDeployment(
            Topology(shards=1, shard_resources={"CPU": 3}, drafter_resources={"CPU": 0.1}),
            str(tiny_model_dir),
            "float32",
        )
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
def test_smollm2_two_shards_equal_single_process(ray_local):  # noqa: F811
    """Real weights: 2 shards over Ray reproduce the in-process engine (fp32, 2 prompts, 16 tokens),
    for the retrieval drafter and the trained EAGLE-3 and SpecBlock checkpoints."""
    from speculation import assets
    from speculation.model.target import TargetModel

    model, tok = assets.load_model_and_tokenizer("smollm2-135m", torch.float32)
    target = TargetModel(model, tok)
    specs = resolve_methods(["retrieval", "eagle3", "specblock"], {"retrieval": {"cost_aware": False},
                                                                   "eagle3": {"total_tokens": 24},
                                                                   "specblock": {"total_tokens": 24}})
    engine = EngineConfig(max_new_tokens=16)
    prompts = [
        "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry.",
        "Write a Python function that returns the sum of a list of numbers.",
    ]
    # local_target: drafters are built here and shipped to the worker (the CLI's path).
    with RayDeployment(
        Topology(shards=2, **TOPO),
        "smollm2-135m",
        "float32",
        local_target=target,
    ) as dep:
        # The shards load the tokenizer too and apply the in-process target's EOS rule.
        assert dep.backend.eos_token_ids == target.eos_token_ids
        for text in prompts:
            ids = assets.encode_turn(tok, [], text)
            vanilla = generate_vanilla(target, ids, engine).tokens
            for spec in specs:  # retrieval, and the committed trained checkpoints
                ref = generate_speculative(target, build_drafter(spec, target), ids, engine)
                got = generate_speculative(dep.backend, dep.drafter(spec), ids, engine)
                assert got.tokens == ref.tokens == vanilla, spec.name
                assert [s.tree_size for s in got.steps] == [s.tree_size for s in ref.steps], spec.name
