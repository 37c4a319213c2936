"""How a decode batch's requests came from the batch before it (no sglang import): runs of the old batch kept in
order, and the positions that are new, so a per-batch column is carried over by slicing instead of rebuilt.

SGLang's scheduler changes a running decode batch between rounds by ``filter_batch`` (finished requests out, the
rest kept in order) and ``merge_batch`` (new requests appended at the end); a retraction may reorder it. At high
concurrency the batch changes most rounds, and a column rebuilt per request costs O(bs) passes each time; carried
over, it costs one identity pass to find the change (C-level, stopping at each difference) plus a slice per
run, and Python only for the requests that are new. Worked example: old ``(a, b, c, d, ...)``, new ``(a, c, d,
..., e)`` -> kept ``old[0:1]``, kept ``old[2:n]``, new ``[n-1:n]``; a column ``(A, B, C, D, ...)`` becomes ``(A,
C, D, ..., E)`` with ``E`` computed for ``e`` alone.

Requests are matched by identity (SGLang's ``Req`` has no ``__eq__``; a stand-in's value equality must not pass
for it), through the old batch's ids. A change of more pieces than :data:`MOST` or a quarter of the batch,
whichever is more (a reordered batch; each piece costs a slice per column, each request of a rebuild a pass),
is no diff, nor is one that keeps fewer than :data:`FEWEST` requests (a small batch, or one replaced): the caller
builds its columns again.

>>> reqs = [object() for _ in range(40)]
>>> new = object()
>>> change = diff(tuple(reqs), tuple(reqs[:1] + reqs[2:] + [new]))
>>> change.pieces
((True, 0, 1), (True, 2, 40), (False, 39, 40))
>>> change.apply(tuple(range(40)), lambda i, j: ["new"] * (j - i))[:3], change.fresh()
((0, 2, 3), [(39, 40)])
>>> diff(tuple(reqs[:4]), tuple(reqs[1:4])) is None  # few requests: rebuilt
True
"""

from __future__ import annotations

import collections
import itertools
import operator
from typing import Callable, Deque, List, Optional, Sequence, Tuple

__all__ = ["BatchDiff", "diff", "carried_from", "MOST", "FEWEST"]

MOST = 8  # pieces past which a change is rebuilt, not carried over (or a quarter of the batch, when more)
FEWEST = 32  # requests kept below which a change is rebuilt: a carry's fixed cost is some 25 requests' rebuild


class BatchDiff:
    """The new batch as ``pieces`` in its order: ``(True, i, j)`` the old batch's positions ``[i, j)``, kept in
    order; ``(False, i, j)`` the new batch's positions ``[i, j)``, requests the old batch did not hold there.
    Kept pieces come in increasing old order (an old request that moved back is a new position here)."""

    __slots__ = ("pieces", "old_len", "new_len", "old_ids")

    def __init__(self, pieces: tuple, old_len: int, new_len: int, old_ids: Optional[tuple] = None):
        self.pieces, self.old_len, self.new_len = pieces, old_len, new_len
        self.old_ids = old_ids  # id() of each old request, when the change needed them (carried over with the rest)

    @property
    def same(self) -> bool:
        """Whether the new batch is the old one (every request kept, in order)."""
        return self.old_len == self.new_len and (self.new_len == 0 or self.pieces == ((True, 0, self.old_len),))

    def apply(self, old: Sequence, fresh: Callable[[int, int], Sequence], noted: bool = False) -> tuple:
        """The new batch's column from the old batch's ``old`` (one value per old request): kept runs sliced, the
        new positions ``[i, j)`` from ``fresh(i, j)`` (``j - i`` values). ``noted``: the column's lineage is kept
        (:func:`carried_from`), so what is derived from it can be carried over in turn."""
        parts = [tuple(old[i:j]) if kept else tuple(fresh(i, j)) for kept, i, j in self.pieces]
        out = parts[0] if len(parts) == 1 else sum(parts, ())  # a few concatenations: copies of pointers
        if noted:
            _LINEAGE.append((out, old, self))
        return out

    def removed(self, old: Sequence) -> List[Sequence]:
        """The runs of ``old`` (the old batch's column) whose requests the new batch does not keep."""
        out, at = [], 0
        for kept, i, j in self.pieces:
            if kept:
                if i > at:
                    out.append(old[at:i])
                at = j
        if at < self.old_len:
            out.append(old[at:])
        return out

    def fresh(self) -> List[Tuple[int, int]]:
        """The new batch's positions ``(i, j)`` that are not kept runs of the old one."""
        return [(i, j) for kept, i, j in self.pieces if not kept]


# (a column carried over, the column it came from, the change): the last few noted (BatchDiff.apply)
_LINEAGE: Deque[tuple] = collections.deque(maxlen=4)


def carried_from(column) -> Optional[tuple]:
    """``(the old column, the change)`` when ``column`` (by identity) was carried over lately with ``noted``
    (:meth:`BatchDiff.apply`), else None: a value built from the old column (a row table, a plan) is carried over
    with it."""
    for out, old, change in tuple(_LINEAGE):  # a snapshot: never iterated while another caller appends
        if out is column:
            return old, change
    return None


def _agree(new: Sequence, i: int, old: Sequence, j: int) -> int:
    """How many requests from ``new[i]`` on are ``old``'s from ``old[j]`` on, the same objects in order (a C-level
    pass that stops at the first difference)."""
    n = min(len(new) - i, len(old) - j)
    pairs = map(operator.is_not, new[i:] if i else new, old[j:] if j else old)  # slices copy pointers: cheaper than
    return next(itertools.compress(itertools.count(), pairs), n)  # an islice, which walks up to its start


# (old, new, diff): the last changes, asked again by each per-batch cache (the batch's, and its members' when some
# requests are native)
_LAST: Deque[tuple] = collections.deque(maxlen=2)


def diff(old: tuple, new: tuple, old_ids: Optional[tuple] = None) -> Optional[BatchDiff]:
    """How ``new`` (the batch's requests now) came from ``old`` (the batch before; both tuples), or None when the
    change takes more than :data:`MOST` pieces (or a quarter of ``new``, when more) or keeps fewer than
    :data:`FEWEST` requests. ``old_ids`` (``tuple(map(id, old))``) when the caller keeps them;
    found here otherwise, once a request differs. The last answer is kept: a batch's caches ask for the same
    change in turn."""
    m, n = len(new), len(old)
    if m < FEWEST or n < FEWEST:  # too few to keep: the caller's rebuild costs less than a carry
        return None
    for held, now, answer in tuple(_LAST):  # a snapshot: never iterated while another caller appends
        if held is old and now is new:
            return answer
    most = max(MOST, m // 4)
    pieces: list = []
    i = j = 0
    while i < m and len(pieces) <= most:
        k = _agree(new, i, old, j)
        if k:
            pieces.append((True, j, j + k))
            i, j = i + k, j + k
            continue
        if j < n:  # new[i] is not old[j]: an old request further on (those between left), or one old did not hold
            if old_ids is None:
                old_ids = tuple(map(id, old))
            try:
                j = old_ids.index(id(new[i]), j + 1)
                continue
            except ValueError:
                pass
        stop = i + 1 if j < n else m  # the old batch used up: the rest is new
        if pieces and not pieces[-1][0]:  # pieces tile the new batch in order: the last one ends at i
            pieces[-1] = (False, pieces[-1][1], stop)
        else:
            pieces.append((False, i, stop))
        i = stop
    kept = sum(j - i for carried, i, j in pieces if carried)
    out = BatchDiff(tuple(pieces), n, m, old_ids) if len(pieces) <= most and kept >= FEWEST else None
    _LAST.append((old, new, out))
    return out
