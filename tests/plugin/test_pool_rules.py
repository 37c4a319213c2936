"""Pool-rule helpers against plain-Python oracles."""

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
    pool = [v for v in SPECIAL if v != (0.0 if seed % 2 else -0.0)]
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


def test_key_worked_example():
    """The docstring's example: [-1, -.5, -1] -> topk(2) gives columns 1 then 0."""
    assert flat_order_key(torch.tensor([[-1.0, -0.5, -1.0]])).topk(2).indices.tolist() == [[1, 0]]
