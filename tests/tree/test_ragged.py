"""Ragged rows <-> grids (``tree/ragged.py``) against plain Python loops over the grid."""

import pytest
import torch

from treespec_sglang.tree import from_grid, kept_rows, to_grid


@pytest.mark.parametrize("seed", range(6))
def test_rows_grid_and_back_equal_loops(seed):
    g = torch.Generator().manual_seed(seed)
    bs, n = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
    keep = torch.rand(bs, n, generator=g) < 0.5
    want_rows = [b * n + i for b in range(bs) for i in range(n) if keep[b, i]]  # request-major, index order
    rows = kept_rows(keep, len(want_rows))
    assert rows.tolist() == want_rows
    x = torch.randn(len(want_rows), 3, generator=g)
    for fill in (0.0, float("-inf")):
        grid = to_grid(x, rows, bs, n, fill=fill)
        assert grid.shape == (bs, n, 3)
        t = 0
        for b in range(bs):
            for i in range(n):
                if keep[b, i]:
                    assert torch.equal(grid[b, i], x[t])
                    t += 1
                else:
                    assert (grid[b, i] == fill).all()
        assert torch.equal(from_grid(grid, rows), x)
    ids = torch.arange(len(want_rows))  # integer entries, no trailing dims
    assert to_grid(ids, rows, bs, n, fill=-1).reshape(-1).tolist() == [
        want_rows.index(r) if r in want_rows else -1 for r in range(bs * n)]
