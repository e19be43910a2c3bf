"""A deliberately broken build, made by the drill's self-test only: with this folder first
on ``PYTHONPATH``, every Python process the drill starts (its workers included) applies a
reviewer's decision without comparing the environment it was signed for with the one
observed now, so a decision signed before the environment moved applies. The product has
no switch for this; the break lives here, in the test."""

from __future__ import annotations

from typing import Any

from ratchet.runtime import decisions

_checked = decisions.apply_review_decision


def _blind(state: Any, scenario: Any, decision: Any, reviewers: Any, **kw: Any) -> Any:
    observed = kw["observed"]
    # The environment as the decision says it was: the binding check sees no move.
    kw["observed"] = observed.model_copy(update={"version": decision.claims.env_version})
    return _checked(state, scenario, decision, reviewers, **kw)


decisions.apply_review_decision = _blind
