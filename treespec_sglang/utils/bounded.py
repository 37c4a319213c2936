"""A memo table that starts again when full.

The plugin keeps per-process tables keyed by what a server sees an unbounded number of over its life (parameter
sets, batch compositions, classifier sets); each is a :class:`Bounded`, so memory stays flat however many arrive,
and a key dropped by a restart is built again on its next miss: slower once, never a different answer.
"""

from __future__ import annotations

from typing import TypeVar

V = TypeVar("V")


class Bounded(dict):
    """A ``dict`` of at most ``cap`` entries. Lookups are the dict's own (``get``, ``in``, ``[]``: one C call on a
    hot path); :meth:`put` adds an entry, emptying the table first when it is full and the key is new.

    Examples
    --------
    >>> t = Bounded(2)
    >>> t.put("a", 1), t.put("b", 2), t.put("b", 3), dict(t)
    (1, 2, 3, {'a': 1, 'b': 3})
    >>> t.put("c", 4), dict(t)
    (4, {'c': 4})
    """

    __slots__ = ("cap",)

    def __init__(self, cap: int):
        if not isinstance(cap, int) or cap < 1:
            raise ValueError(f"Bounded: cap must be an int >= 1, got {cap!r}")
        super().__init__()
        self.cap = cap

    def put(self, key, value: V) -> V:
        """``self[key] = value``, returned; a new key in a full table empties it first."""
        if len(self) >= self.cap and key not in self:
            self.clear()
        self[key] = value
        return value
