"""``engine/exactness.py``'s verdict over a run's outputs, with each divergence's margin given: identical
outputs (a shorter one that is a prefix is not the same), the largest margin (0 with none), and ties up to
:data:`TIE_BOUND` included."""

import pytest

import treespec_sglang.engine.exactness as X


@pytest.fixture
def margins(monkeypatch):
    """The margin of each prompt's first divergence, by prompt (None: the outputs agree)."""
    given = {}
    monkeypatch.setattr(X, "divergence_margin", lambda engine, p, r, o: given[tuple(p)])
    return given


@pytest.mark.parametrize("given, outs, want", [
    ({(1,): None, (2,): None}, [[5, 6], [7]], dict(same=True, diverged=0, max_margin=0.0, ok=True)),
    ({(1,): None, (2,): None}, [[5], [7]], dict(same=False, diverged=0, max_margin=0.0, ok=True)),  # a prefix
    ({(1,): X.TIE_BOUND, (2,): None}, [[5, 9], [7]], dict(same=False, diverged=1, max_margin=X.TIE_BOUND, ok=True)),
    ({(1,): 0.25, (2,): X.TIE_BOUND + 0.5}, [[5, 9], [8]],
     dict(same=False, diverged=2, max_margin=X.TIE_BOUND + 0.5, ok=False)),
], ids=["same", "a shorter output", "a tie at the bound", "a real divergence"])
def test_a_runs_verdict(margins, given, outs, want):
    margins.update(given)
    assert X.compare_outputs("engine", [[1], [2]], [[5, 6], [7]], outs) == want
