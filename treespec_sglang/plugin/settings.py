"""The plugin's ``TREESPEC_*`` environment as the hooks read it: live until the server starts serving, then frozen.

Operator switches travel as environment variables (``configure`` and ``--treespec-*`` export them before SGLang
spawns its scheduler processes, which inherit them). A round reads about ten of them (the server defaults, the
selection mode, the stats cap, the ragged switch, two debug switches), and one ``os.environ`` read costs about a
microsecond of host time (the key is encoded, looked up, the value decoded): a tenth of a treespec round's own
host time at one request. The draft worker's start (``EagleDraftWorker.init_lm_head``, where the settings are
parsed, checked and compared across ranks) calls :func:`freeze`; from then on :func:`env` answers from one
snapshot, a dict read. Before that (tests, tools, a process that never serves) every read is live.

Freezing also makes the start's checks binding: the settings the ranks agreed on are the ones every round
reads, even if something in the process edits the environment later. :func:`thaw` undoes it (tests).

    >>> import os
    >>> os.environ["TREESPEC_EXAMPLE"] = "1"; freeze(); os.environ["TREESPEC_EXAMPLE"] = "2"
    >>> env("TREESPEC_EXAMPLE"), frozen()
    ('1', True)
    >>> thaw(); env("TREESPEC_EXAMPLE")
    '2'
    >>> del os.environ["TREESPEC_EXAMPLE"]
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Dict, Optional, TypeVar

__all__ = ["PREFIX", "env", "freeze", "thaw", "frozen", "derived"]

T = TypeVar("T")

PREFIX = "TREESPEC_"
_SNAPSHOT: Optional[Dict[str, str]] = None  # the frozen TREESPEC_* variables; None: read os.environ


def env(name: str, default: str = "") -> str:
    """``name``'s value (a ``TREESPEC_*`` variable), or ``default`` when unset: from the snapshot once frozen."""
    if not name.startswith(PREFIX):
        raise KeyError(f"settings.env reads TREESPEC_* variables only, not {name!r} (the snapshot holds no other)")
    if _SNAPSHOT is None:
        return os.environ.get(name, default)
    return _SNAPSHOT.get(name, default)


def freeze() -> None:
    """Snapshot every ``TREESPEC_*`` variable now; :func:`env` reads the snapshot from here on (idempotent: a
    second call takes a new snapshot)."""
    global _SNAPSHOT
    _SNAPSHOT = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}


def thaw() -> None:
    """Back to live reads."""
    global _SNAPSHOT
    _SNAPSHOT = None


def frozen() -> bool:
    return _SNAPSHOT is not None


def derived(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorator: ``fn(*args)`` (a value parsed from the settings; hashable arguments) computed once per frozen
    snapshot and arguments, kept until the next :func:`freeze` or :func:`thaw`; called every time while live.
    A call that raises is not kept (it raises again). A round asks for about ten such values: each is then a
    dict read instead of a parse (``env`` + strip + parse, ~0.5 us).

        >>> calls = []
        >>> @derived
        ... def cap(): calls.append(1); return int(env("TREESPEC_EXAMPLE_CAP", "4"))
        >>> freeze(); cap(), cap(), len(calls)
        (4, 4, 1)
        >>> thaw(); cap(), len(calls)
        (4, 2)
    """
    kept: Dict[tuple, T] = {}
    seen = [None]  # the snapshot ``kept`` belongs to

    @functools.wraps(fn)
    def value(*args) -> T:
        snap = _SNAPSHOT
        if snap is None:
            return fn(*args)
        if seen[0] is not snap:
            kept.clear()
            seen[0] = snap
        try:
            return kept[args]
        except KeyError:
            v = kept[args] = fn(*args)
            return v

    return value
