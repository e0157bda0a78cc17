"""The drafter table: every drafter is declared once, and the engine, --mode and auto follow the table."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from edgespec.drafters import table as drafter_table
from edgespec.drafters.table import DRAFTERS, build_drafters, spec_for
from edgespec.drafters import Draft, DrafterKind, DrafterSpec, DraftSources
from edgespec.errors import EdgespecError
from edgespec.runtimes.base import NextTokenHeads
from edgespec.policy import DEFAULT_DRAFT_MAX, MODES, NO_DRAFT, AdaptivePolicy, resolve_mode
from edgespec.machine.profile import CostProfile
from edgespec.sampling import Sampler, SamplingParams
from edgespec.drafters.suffix import SuffixHistory

MS = 1e-3


def test_every_row_is_a_mode_with_a_default_k():
    names = [spec.name for spec in DRAFTERS]
    assert len(set(names)) == len(names)
    assert MODES == ("auto", "ar", *names)
    assert all(DEFAULT_DRAFT_MAX[name] == spec_for(name).default_k for name in names)
    with pytest.raises(EdgespecError, match="not in the drafter table"):
        spec_for("no-such-drafter")


def test_built_drafters_carry_their_rows_name():
    draft_model = SimpleNamespace(tokens=np.zeros(0, dtype=np.int32))  # stands in for a runtime
    head = SimpleNamespace(tokens=np.zeros(0, dtype=np.int32))
    target = SimpleNamespace(capabilities={NextTokenHeads}, next_token_head=lambda: head)  # a model with an MTP head
    built = build_drafters(DraftSources(draft=draft_model, target=target, history=SuffixHistory()))
    assert list(built) == [spec.name for spec in DRAFTERS]
    assert all(drafter.name == name for name, drafter in built.items())


def test_a_drafter_the_models_do_not_allow_is_not_offered():
    built = build_drafters(DraftSources(history=SuffixHistory()))  # no draft model loaded
    models = [spec.name for spec in DRAFTERS if spec.kind is DrafterKind.MODEL]
    assert models and not set(models) & set(built)
    for name in models:
        with pytest.raises(EdgespecError, match="needs a draft model" if name == "draft" else "needs a model with MTP"):
            resolve_mode(name, built)
    assert all(resolve_mode(name, built) == name for name in built)


def test_a_copying_drafter_must_declare_what_asking_it_costs():
    with pytest.raises(ValueError, match="ask_s"):
        DrafterSpec("echo", DrafterKind.COPIES, "echo", default_k=4, build=lambda sources: None)


class _Echo:
    """A model-free drafter unknown to the policy: proposes the committed text's first tokens again."""

    name = "echo"

    def prepare(self, context):
        pass

    def propose(self, context, k, sampler, gate=None, branch=None):
        return Draft(np.asarray(context[:k], dtype=np.int32))


def test_a_registered_model_free_drafter_is_built_asked_and_chosen_by_auto(monkeypatch):
    """Adding a drafter is its class and its row: the engine's table builds it, and auto asks it every
    round (shadow proposals) and drafts with it once its proposals prove right, naming it nowhere."""
    row = DrafterSpec("echo", DrafterKind.COPIES, "the prompt again", default_k=4,
                      build=lambda sources: _Echo(), ask_s=lambda profile: profile.lookup_s)
    monkeypatch.setitem(drafter_table.BY_NAME, "echo", row)
    drafters = build_drafters(DraftSources(history=SuffixHistory()))
    assert isinstance(drafters["echo"], _Echo)

    # each verified row costs half a step: a coin-flip draft does not pay, a copy that proves right does
    costs = CostProfile({n: 10 * MS * (1 + 0.5 * (n - 1)) for n in (1, 2, 4, 8)}, None, None, 0.05 * MS)
    policy = AdaptivePolicy(costs, drafters["echo"], k_max=4)
    context = [7, 8, 9, 10, 11, 12, 13]
    state = SimpleNamespace(committed=np.asarray(context, dtype=np.int32), remaining=100, n=len(context),
                            n_prompt=0, sampler=Sampler(SamplingParams(temperature=0), 0), forced=0)
    assert policy.choose(state).drafter is None  # not trusted on its word
    for _ in range(30):  # plain rounds whose tokens confirm what echo proposed: it learns in the shadow
        policy.choose(state)
        policy.observe(NO_DRAFT, 0, 0, np.array(context[:4]))
    choice = policy.choose(state)
    assert choice.drafter is drafters["echo"] and choice.k == 4
    assert list(choice.draft.tokens) == context[:4]
