"""Ragged batches: the kept entries of a ``[bs, n]`` grid as ``T`` flat rows and back.

One vocabulary for every ragged forward (the engine's token-capped verify, the draft's pruned frontier, the
target's ragged attention, the plugin's compacted verify): ``rows`` ``[T]`` int64 are flat indices
``b * n + i`` of the kept entries, request-major and in index order; a ``[T, ...]`` tensor holds one entry per
row in that order.

Example: keep [[T, F, T], [F, T, F]] -> rows [0, 2, 4]; to_grid(x, rows, 2, 3) puts x[0], x[1], x[2] at
(0, 0), (0, 2), (1, 1) and ``fill`` elsewhere; from_grid(grid, rows) reads them back.
"""

from __future__ import annotations

import torch

__all__ = ["kept_rows", "to_grid", "from_grid"]


def kept_rows(keep: torch.Tensor, count: int) -> torch.Tensor:
    """Flat row indices of the kept entries, row-major (a ragged forward's ``rows``), without boolean-mask
    indexing: a stable sort of "not kept" puts them first.

    Parameters
    ----------
    keep : ``[bs, n]`` bool; count : host int, the number of kept entries (the caller's one host read).

    Returns
    -------
    ``[count]`` int64. Example: keep [[T, F], [F, T]], count 2 -> [0, 3].
    """
    return torch.sort((~keep).reshape(-1).to(torch.uint8), stable=True).indices[:count]


def to_grid(x: torch.Tensor, rows: torch.Tensor, bs: int, n: int, fill: float = 0.0) -> torch.Tensor:
    """``[T, ...]`` entries -> ``[bs, n, ...]`` with each at its row, ``fill`` elsewhere.

    Example: x [[1.], [2.]], rows [0, 3], bs 2, n 2 -> [[[1.], [0.]], [[0.], [2.]]]."""
    grid = x.new_full((bs * n,) + tuple(x.shape[1:]), fill).index_copy_(0, rows, x)
    return grid.view((bs, n) + tuple(x.shape[1:]))


def from_grid(grid: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[bs, n, ...]`` -> the ``[T, ...]`` entries at ``rows`` (the inverse of :func:`to_grid`)."""
    return grid.flatten(0, 1).index_select(0, rows)
