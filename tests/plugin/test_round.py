"""``plugin.round``: one round's state in one object: current only inside :func:`opened` (raise or return), the
draft step's defaults, whether a round carries a treespec request (the profiler's and the graph counter's label),
and the requests' identity check the per-batch caches key on."""

from types import SimpleNamespace

import pytest

from treespec_sglang.plugin.round import DraftStep, current, drafting_step, opened, same_requests
from treespec_sglang.policies import parse_spec


def test_a_round_is_current_inside_opened_only_and_nested_rounds_restore_the_outer():
    assert current() is None
    with opened(["a"]) as outer:
        assert current() is outer and outer.reqs == ["a"] and drafting_step() is None
        with pytest.raises(RuntimeError):
            with opened() as inner:
                assert current() is inner is not outer
                raise RuntimeError("a hook failed")
        assert current() is outer
        outer.step, outer.drafting = DraftStep([None], 4), True
        assert drafting_step() is outer.step
        outer.drafting = False
        assert drafting_step() is None  # verify and draft extend see no draft step
    assert current() is None


def test_a_draft_step_shares_nothing_unless_told():
    p = parse_spec({"policy": "talon", "budget": 8})
    assert DraftStep([p, None, p], 4).shares == [False, False, False]
    assert DraftStep([p, None], 4, shares=[True, False]).shares == [True, False]
    assert DraftStep([], 4).shares == []


@pytest.mark.parametrize("step,params,want", [
    (False, [None, None], False),  # a native batch: SGLang's round
    (False, [None, "talon"], True),  # one request with a policy
    (False, ["none"], True),  # speculation off is a treespec policy too
    (True, [None], True),  # drafted with a step (the requests' params are not read)
    (False, [], False),
])
def test_a_round_carries_treespec_when_it_has_a_step_or_a_request_with_params(step, params, want):
    reqs = [SimpleNamespace() if s is None else SimpleNamespace(_treespec_params=parse_spec({"policy": s}))
            for s in params]
    with opened(reqs) as r:
        r.step = DraftStep([None] * len(params), 4) if step else None
        assert r.carries_treespec() is want
    with opened(None) as r:
        assert r.carries_treespec() is False


def test_same_requests_is_identity_in_order_not_equality():
    a, b = SimpleNamespace(rid=1), SimpleNamespace(rid=1)
    assert a == b and not same_requests([b], (a,))
    held = (a, b)
    assert same_requests(held, held) and same_requests([a, b], held)
    assert not same_requests([b, a], held) and not same_requests([a], held) and not same_requests([a, b, a], held)
    assert same_requests([], ()) and not same_requests([b], (a,)) and same_requests([a], (a,))
    assert not same_requests([a, a], (b, a))  # the last ones agree, an earlier one does not
