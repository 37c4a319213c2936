"""The batch tail's price against a brute-force oracle: every way to draw the batch's taus, each batch run
round by round with its active rows counted."""

import pytest

from tests.engine.tail_oracle import walk_batch_ms
from treespec_sglang.engine.batch_tail import batch_ms_per_token


def test_docstring_example():
    assert batch_ms_per_token([2, 4], 2, 10.0, 16.0) == pytest.approx(6.25)
    assert walk_batch_ms([2, 4], 2, 10.0, 16.0) == pytest.approx(6.25)


@pytest.mark.parametrize("taus,bs", [([1.5, 2.0, 3.7], 3), ([2.2, 2.2, 4.0, 1.0], 4), ([3.0], 5),
                                     ([1.2, 2.5, 1.9, 3.3, 2.0], 2), ([1.7, 2.9], 6)])
@pytest.mark.parametrize("c1,cb", [(30.0, 60.0), (40.0, 40.0), (25.0, 180.0)])
def test_matches_the_round_by_round_oracle(taus, bs, c1, cb):
    assert batch_ms_per_token(taus, bs, c1, cb) == pytest.approx(walk_batch_ms(taus, bs, c1, cb), rel=1e-12)


@pytest.mark.parametrize("taus", [[1.3, 2.0, 4.5], [2.5]])
def test_one_request_is_the_round_over_the_mean_rounds(taus):
    # bs 1: no tail; the expected rounds per token are the mean of 1 / tau, priced at c1 (cb is not read)
    mean_r = sum(1 / t for t in taus) / len(taus)
    assert batch_ms_per_token(taus, 1, 30.0, 999.0) == pytest.approx(30.0 * mean_r)


@pytest.mark.parametrize("bs", [2, 4, 16])
def test_no_spread_is_the_untailed_price(bs):
    assert batch_ms_per_token([2.5] * 7, bs, 30.0, 70.0) == pytest.approx(70.0 / 2.5)


def test_rounds_that_cost_the_same_at_any_batch_wait_for_the_slowest_request():
    # c1 == cb: the batch costs its slowest request's rounds, E[max r], which grows with bs towards max r
    taus = [1.4, 2.0, 2.6, 3.5]
    mean_r = sum(1 / t for t in taus) / len(taus)
    ratios = [batch_ms_per_token(taus, bs, 36.0, 36.0) / (36.0 * mean_r) for bs in (2, 4, 8, 64)]
    assert 1.0 < ratios[0] < ratios[1] < ratios[2] < ratios[3] < 1 / 1.4 / mean_r
    assert ratios[3] == pytest.approx(1 / 1.4 / mean_r, rel=1e-6)


@pytest.mark.parametrize("bad,match", [(dict(bs=0), "bs must be"), (dict(bs=True), "bs must be"),
                                       (dict(taus=[]), "^taus must hold at least one per-prompt tau$"),
                                       (dict(taus=[0.9, 2.0]), "every tau"), (dict(taus=[float("nan")]), "every tau")])
def test_bad_input_is_refused(bad, match):
    args = dict(taus=[2.0], bs=2, c1=10.0, cb=12.0) | bad
    with pytest.raises(ValueError, match=match):
        batch_ms_per_token(**args)
