"""Pool-rule helpers against plain-Python oracles."""

import math
import random
import struct

import pytest
import torch

from treespec_sglang.plugin.pool_rules import flat_order_key

SPECIAL = [float("-inf"), float("inf"), -0.0, 0.0, -1.0, 1.0, -1e-38, 1e-38, -3.4e38, 3.4e38, -1e-45, 1e-45]


def _stable_desc(row):  # a plain loop: columns by value, high first, ties to the lower column
    return sorted(range(len(row)), key=lambda c: (-row[c], c))


@pytest.mark.parametrize("seed", range(6))
def test_topk_on_the_key_is_a_stable_descending_sort(seed):
    """Random float32 rows with many exact ties and every kind of special value (infinities, signed zeros,
    subnormals, extremes): ``topk`` of the key picks the columns a stable descending sort puts first, at
    every k. -0.0 and 0.0 compare equal in the oracle, so they are left out of the same row."""
    rng = random.Random(seed)
    w = rng.choice([5, 17, 64, 300])
    drop = 1.0 if seed % 2 else -1.0  # the sign of the zero left out of this row
    pool = [v for v in SPECIAL if not (v == 0 and math.copysign(1.0, v) == drop)]
    rows = []
    for _ in range(4):
        vals = [rng.choice(pool) if rng.random() < .3 else rng.choice([-2.5, -.125, .75, rng.uniform(-50, 5)])
                for _ in range(w)]
        rows.append([struct.unpack("f", struct.pack("f", v))[0] for v in vals])  # exactly float32
    x = torch.tensor(rows, dtype=torch.float32)  # [4, w]
    key = flat_order_key(x)
    assert key.dtype == torch.int64 and key.shape == x.shape
    for k in (1, 3, w):
        got = key.topk(k, dim=-1).indices.tolist()
        assert got == [_stable_desc(r)[:k] for r in rows], k


@pytest.mark.parametrize("v", [-7.25, -1e-30, 0.5, 3e5])
@pytest.mark.parametrize("w", [2, 9])
def test_one_ulp_apart_outranks_any_column(v, w):
    """Two values one float32 ulp apart at opposite ends of a row: the larger one ranks first wherever it
    sits, and equal values still go by column (an ordinal step must outweigh every column offset)."""
    lo = torch.tensor(v, dtype=torch.float32)
    hi = torch.nextafter(lo, torch.tensor(float("inf")))
    for first, last in ((lo, hi), (hi, lo)):
        x = torch.full((1, w), -1e30)
        x[0, 0], x[0, w - 1] = first, last
        want = [0, w - 1] if first > last else [w - 1, 0]
        assert flat_order_key(x).topk(2).indices.tolist() == [want], (first, last)
    x = torch.full((1, w), float(lo))
    assert flat_order_key(x).topk(w).indices.tolist() == [list(range(w))]


def test_key_worked_example():
    """The docstring's example: [-1, -.5, -1] -> topk(2) gives columns 1 then 0."""
    assert flat_order_key(torch.tensor([[-1.0, -0.5, -1.0]])).topk(2).indices.tolist() == [[1, 0]]
