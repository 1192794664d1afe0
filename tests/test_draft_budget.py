"""DraftBudgetPolicy on its own: its config, the no-rule plan, and a goodput plan from a tiny grid."""

from __future__ import annotations

import dataclasses

import pytest

from speculation.policy.draft_budget import DraftBudgetConfig, DraftBudgetPolicy
from speculation.policy.goodput import BatchCostModel
from speculation.spec.step import DraftingCheck, StepPlan, StepResult
from speculation.spec.tree import DraftTree


@pytest.mark.parametrize("kwargs", [{"max_tree_tokens": 0}, {"max_tree_tokens": True},
                                    {"max_tree_tokens": 8, "step_token_budget": 0},
                                    {"max_tree_tokens": 8, "payoff_veto": "yes"}])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="draft budget"):
        DraftBudgetConfig(**kwargs)


def test_without_a_cost_model_every_step_drafts_whole_trees():
    policy = DraftBudgetPolicy(DraftBudgetConfig(8), None)
    seqs = [policy.new_sequence(), policy.new_sequence()]
    assert not policy.active
    assert policy.check(seqs, [10, 12], [8, 8]) is DraftingCheck.DRAFT
    plan = policy.plan(DraftingCheck.DRAFT, seqs, [10, 12], [5, 7], [True, True], 0.01)
    assert plan == StepPlan(DraftingCheck.DRAFT) and plan.drafts is None and not plan.stats
    policy.observe(plan, StepResult((DraftTree(1), DraftTree(2)), ([0], [0]), (0, 0), 0.01, 0.0, 0.0), seqs)
    assert seqs[0].ranks.explored == 0 and policy.pooled_ranks.explored == 0  # nothing learnt


def test_a_free_grid_grants_drafts_and_the_plan_is_frozen():
    cheap = BatchCostModel({64: {1: {1: 0.01, 8: 0.0101}, 2: {1: 0.01, 8: 0.0101}}})
    policy = DraftBudgetPolicy(DraftBudgetConfig(8), cheap)
    seqs = [policy.new_sequence(), policy.new_sequence()]
    check = policy.check(seqs, [10, 12], [8, 8])
    assert check is DraftingCheck.DRAFT and not check.skips
    plan = policy.plan(check, seqs, [10, 12], [7, 7], [True, True], 0.0)
    assert plan.drafted and plan.drafts is not None and len(plan.drafts) == 2
    assert all(n <= 1 for n in plan.drafts) and sum(plan.drafts) > 0  # ranks open by doubling: 1 first
    assert plan.stats["goodput_drafting_skipped"] == 0.0
    assert seqs[0].draft_size == 7.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.drafts = (0, 0)  # type: ignore[misc]
