"""The row table: each request's policy parameters as one float32 row on the device (no sglang import).

A selection reads a batch's policies from a ``[bs, F]`` table (:data:`COLUMNS`), not from Python objects, so
its ops do not depend on the batch's content: each request's row is built once per distinct parameter set
(:func:`request_row`) and a batch's table is its rows concatenated (:func:`policy_rows`), kept per batch
composition (:func:`per_batch`) like the batch's plan (:class:`.pool.BatchPlan`), so a steady batch costs
the host neither the walk nor the op. The ``kind`` column numbers the registry (:func:`kind_id`), the
``clf`` column the classifiers in first-seen order (:func:`classifier_ids`), and a policy's other columns
come from its registration's ``pool_rule.row``.
"""

from __future__ import annotations

import collections
from typing import Deque, Dict, List, Optional, Sequence

import torch

from ..policies.params import PolicyParams
from ..policies.registry import REGISTRY, pool_rule_of, registration_of
from ..utils.bounded import Bounded
from ..utils.syncs import to_device
from .batch_diff import carried_from
from .classifiers import DEFAULT_NAME, registered

__all__ = ["COLUMNS", "kind_id", "request_row", "policy_rows", "per_batch", "classifier_ids", "by_id"]

# the row table: one float32 row per request, these columns
COLUMNS = ("kind", "budget", "top", "rank_depth", "topk", "log_mu", "th", "batch", "max_depth", "beta", "clf", "shares")
_C = {name: i for i, name in enumerate(COLUMNS)}
_BIG = 1 << 20

_CLF_IDS: Dict[object, int] = {}  # classifier spec key -> id (the row's "clf" column)
_CLF_SPECS: List[object] = []
_ROWS: Dict[tuple, torch.Tensor] = Bounded(4096)  # (params, shares, device) -> [1, F] row, built once


def _clf_id(spec) -> int:
    """The ``clf`` number of a classifier spec (a module, a path), numbered on first sight. None, what a request
    naming no classifier carries, is the server's ``default`` registration: the operator's file when
    ``--treespec-classifier default=PATH`` maps it, else the shipped classifier (:mod:`.classifiers`)."""
    if spec is None:
        spec = registered()[DEFAULT_NAME]
    key = spec if isinstance(spec, (str, type(None))) else ("module", id(spec))
    if key not in _CLF_IDS:
        _CLF_IDS[key] = len(_CLF_SPECS)
        _CLF_SPECS.append(spec)
    return _CLF_IDS[key]


def kind_id(name: str) -> int:
    """The row table's ``kind`` of policy ``name``: 0 for SGLang's own selection (``"native"``), else 1 + its
    place in the registry (the same in every process: the same imports register in the same order)."""
    return 0 if name == "native" else 1 + list(REGISTRY).index(name)


_RULE_ROWS: Dict[PolicyParams, dict] = Bounded(4096)  # params -> its pool rule's row, computed once


def _rule_row(p: PolicyParams) -> dict:
    """The pool rule's entries for ``p`` (``registration_of(p).pool_rule.row``), cached per parameter set."""
    row = _RULE_ROWS.get(p)
    if row is None:  # no rule: refused on arrival (plugin.request); a request built by hand fails here, not mid-round
        row = dict(pool_rule_of(p).row(p))
        unknown = sorted(set(row) - set(COLUMNS))
        if unknown:  # checked before caching: every later row of these parameters fails the same way
            raise ValueError(f"{registration_of(p).name}: pool_rule.row gave unknown columns {unknown}; "
                             f"allowed: {list(COLUMNS[1:-1])}")
        _RULE_ROWS.put(p, row)
    return row


def _row_values(p: Optional[PolicyParams], shares: bool) -> List[float]:
    # top: how many of SGLang's best pool nodes the row keeps by rank (native N-1, a policy what its rule
    # says, 0 by default); rank_depth: the deepest level that ranking may take; None: unbounded
    v = dict(kind=0.0, budget=float(_BIG), top=float(_BIG), rank_depth=float(_BIG), topk=float(_BIG), log_mu=0.0,
             th=0.0, batch=1.0, max_depth=float(_BIG), beta=-1.0, clf=-1.0, shares=float(shares))
    if p is None:
        return [v[c] for c in COLUMNS]
    v.update(kind=float(kind_id(registration_of(p).name)), budget=float(p.max_nodes), top=0.0)
    for col, value in _rule_row(p).items():
        if col == "clf":  # a classifier spec (None: the default), numbered per process in first-seen order
            value = _clf_id(value)
        v[col] = float(_BIG) if value is None else float(value)
    return [float(v[c]) for c in COLUMNS]


def request_row(p: Optional[PolicyParams], device, shares: bool = False) -> torch.Tensor:
    """A request's ``[1, F]`` float32 parameter row on ``device`` (columns :data:`COLUMNS`).

    Built once per distinct (parameters, shares, device) and cached: a request pays one host->device
    copy when its parameter set is first seen (asynchronous on CUDA: :func:`~..utils.syncs.to_device`, so a new
    request's first round does not wait for the round before), none in the rounds after.

    Examples
    --------
    >>> from treespec_sglang.policies import parse_spec
    >>> row = request_row(parse_spec({"policy": "talon", "budget": 9}), "cpu")[0]
    >>> [row[COLUMNS.index(c)].item() for c in ("kind", "budget", "topk")] == [kind_id("talon"), 9.0, 10.0]
    True
    """
    return _request_row(p, bool(shares), str(torch.device(device)), device)


def _request_row(p: Optional[PolicyParams], shares: bool, where: str, device) -> torch.Tensor:
    """:func:`request_row` with the device's name (``where``) worked out once by the caller (a batch's rows)."""
    row = _ROWS.get((p, shares, where))
    if row is None:
        row = _ROWS.put((p, shares, where), to_device(torch.tensor([_row_values(p, shares)], dtype=torch.float32),
                                                      device))
    return row


# (what, ids of the batch's params, extra) -> (the params, kept alive; value): one per composition seen lately
_BATCHES: Dict[tuple, tuple] = Bounded(256)
_LAST: Dict[str, tuple] = {}  # what -> (the last params tuple, extra, value): a steady batch's hit by identity


def per_batch(what: str, params: Sequence, extra: tuple, build, carry=None):
    """``build()`` once per batch composition: the same parameter objects in the same order (a batch's
    requests keep theirs while they live, so a steady batch hits every round). Keyed by the objects' ids,
    which the entry keeps alive (so no id is reused while it is cached); host cost flat in bs (one C-level
    pass over the ids), where building a row table or a :class:`BatchPlan` walks the batch in Python. A tuple of
    params passed again (the same object: a steady batch's columns, :mod:`.columns`) with the same ``extra`` is
    the last entry's without that pass: a tuple cannot change, and the entry keeps it alive. A composition not
    seen lately whose tuple was carried over from the last one (a changed batch's,
    :func:`.batch_diff.carried_from`) gets ``carry(the last value, its extra, its params, the change)`` when that
    gives one (None: built)."""
    last = _LAST.get(what)
    if last is not None and last[0] is params and last[1] == extra:
        return last[2]
    key = (what, tuple(map(id, params)), extra)
    hit = _BATCHES.get(key)
    if hit is None:
        came = None if carry is None or last is None else carried_from(params)
        value = None
        if came is not None and came[0] is last[0]:
            value = carry(last[2], last[1], last[0], came[1])
        hit = _BATCHES.put(key, (tuple(params), build() if value is None else value))
    if type(params) is tuple:
        _LAST[what] = (params, extra, hit[1])
    return hit[1]


def policy_rows(params: Sequence[Optional[PolicyParams]], device, shares: Optional[Sequence[bool]] = None):
    """``[bs, F]`` row table for a batch (``[0, F]`` for none): the cached rows concatenated (one op, no host->device
    copy), kept per batch composition (:func:`per_batch`: a steady batch pays neither the op nor the walk).
    Read-only."""
    shares = tuple(shares) if shares is not None else (False,) * len(params)
    where = str(torch.device(device))

    def build():
        ids, of = by_id(params)
        if not ids:  # an empty batch (an idle rank's): a table of no rows, as torch.cat cannot make one
            return torch.empty(0, len(COLUMNS), dtype=torch.float32, device=device)
        rows = {(i, s): _request_row(of[i], bool(s), where, device) for i, s in dict.fromkeys(zip(ids, shares))}
        return torch.cat(list(map(rows.__getitem__, zip(ids, shares))))

    def carry(table, old_extra, old_params, change):  # the kept runs' rows sliced, the new requests' looked up
        if old_extra[1] != where:
            return None
        parts = [table[i:j] if kept else torch.cat([_request_row(p, bool(s), where, device) for p, s in
                                                    zip(params[i:j], shares[i:j])]) for kept, i, j in change.pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return per_batch("rows", params, (shares, where), build, carry)


def by_id(params: Sequence) -> tuple:
    """``(each row's id(params), id -> params)``, both built in C: a batch's rows share few parameter sets (a
    server's requests share one object per set: :func:`.request._interned`), so per-set work is done once per set
    and mapped over the rows by id (an int key: no dataclass hash). A round asks for its batch's columns and its
    selection's rows several times: the last two tuples' answers are kept (a tuple cannot change, and the entry
    keeps it alive, so its ids stay its own)."""
    for held, answer in tuple(_BY_ID):  # a snapshot: never iterated while another caller appends
        if held is params:
            return answer
    if not isinstance(params, (tuple, list)):  # read twice below: an iterator would give nothing the second time
        params = tuple(params)
    ids = tuple(map(id, params))
    answer = (ids, dict(zip(ids, params)))
    if type(params) is tuple:
        _BY_ID.append((params, answer))
    return answer


_BY_ID: Deque[tuple] = collections.deque(maxlen=2)  # (params tuple, by_id's answer): the columns', the selection's


def classifier_ids(params) -> List[int]:
    """The ids (the row table's ``clf``) of the classifiers the batch's rows name, ascending."""
    return sorted({_clf_id(_rule_row(p)["clf"]) for p in by_id(params)[1].values() if p is not None
                   and "clf" in _rule_row(p)})
