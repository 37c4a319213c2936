"""A decode batch's per-request policy columns, built once and kept while the batch holds the same requests
(no sglang import): each request's parameters (None: native), whether it shares the token cap, the policies'
names once drafted, the C2T chain stopper, and the parameters the round's selection runs on
(:meth:`BatchColumns.selection`: a request whose policy keeps SGLang's own tree is a native row there).
"""

from __future__ import annotations

import collections
import itertools
import operator
from dataclasses import dataclass
from typing import List, Optional

from ..policies.params import NoneParams
from .chain_stop import ChainStopper
from .pool import keeps_native_tree
from . import batch_diff
from .batch_diff import diff
from .rows import by_id
from .round import same_requests
from .server_hooks import _req_params, _req_shares
from .stats import policy_name

__all__ = ["BatchColumns", "batch_columns", "DRAFTED"]

DRAFTED = "_treespec_drafted"  # on a Req: its policy's name once drafted with it (its stats are ours to keep)


@dataclass
class BatchColumns:
    """A decode batch's per-request policy columns: ``params`` (None: native), ``shares`` (under the token cap),
    and once drafted the policies' names (tuples: the per-batch caches, :func:`.rows.per_batch`, hit a steady
    batch's by identity). SGLang keeps a decode batch's requests from round to round and a
    request's policy never changes, so the columns are built once and reused while the batch holds the same
    requests in the same order under the same defaults (an O(bs) identity check in C). When a batch with policies
    changes by a few runs (requests leave, others join: :mod:`.batch_diff`), its columns are carried over from the
    last batch's by slicing (the names drafted and the selection's when first asked for), only the new requests'
    worked out; a batch of native requests alone, a small one or a reordered one is built again."""

    reqs: tuple
    defaults: object  # the ServerDefaults they were resolved under
    params: tuple
    shares: tuple
    any_policy: bool
    ids: Optional[tuple] = None  # id(req) of each request once a change found them: the next one is found by them
    names: Optional[tuple] = None
    stopper: Optional[ChainStopper] = None
    _selection: Optional[tuple] = None  # ((N, S), each row's params for the selection or None, whether any is not)
    _whole: Optional[tuple] = None  # (N, [N] * bs): every tree SGLang's own
    # (the last batch's requests, their ids, names and selection): what an ask carries over (held, not the last
    # batch's columns: no chain of batches stays alive)
    _last: Optional[tuple] = None

    def whole_trees(self, num_draft_tokens: int) -> list:
        """``[N] * bs``: each request's tree size and verify tokens in a round that is SGLang's own (the host list
        :func:`.stats.record_rounds` takes), built once per N while the batch lives."""
        if self._whole is None or self._whole[0] != num_draft_tokens:
            self._whole = (num_draft_tokens, [num_draft_tokens] * len(self.params))
        return self._whole[1]

    def chain_stopper(self, num_steps: int, device) -> ChainStopper:
        """The batch's :class:`ChainStopper` in chain mode (built the first time, and again when S changes:
        SGLang's adaptive speculation moves a topk-1 server's step count between rounds)."""
        if self.stopper is None or self.stopper.num_steps != num_steps:
            self.stopper = ChainStopper(self.params, num_steps, device)
        return self.stopper

    def selection(self, num_draft_tokens: int, num_steps: int) -> tuple:
        """``(params, tokens)`` for a tree-mode round at N = ``num_draft_tokens`` over S = ``num_steps``: ``params``
        with None for every request whose policy keeps SGLang's own tree there (:func:`.pool.keeps_native_tree`)
        and that the token cap does not cut, ``tokens`` None; or, when that leaves no policy, ``(None, tokens)``:
        the round is SGLang's own (nothing to select, nothing to unlink) and every request's tree is N nodes,
        ``tokens`` the host list of them (its tree sizes and verify tokens). Built once per (N, S) while the batch
        lives; carried over from the last batch's when it was built for the same (N, S)."""
        key = (num_draft_tokens, num_steps)
        if self._selection is None or self._selection[0] != key:
            base, change = None if self._last is None else self._last[3], None
            if base is not None and base[0] == key:
                change = self._change()
            if change is not None:
                cap = self.defaults.token_cap
                served = change.apply(base[1], lambda i, j: [_served(p, s, key, cap) for p, s in
                                                             zip(self.params[i:j], self.shares[i:j])],
                                      noted=True)  # the selection's row table and plan are carried with it
            else:
                served = self._served_column(key)
            self._selection = (key, served, any(map(operator.is_not, served, _NONES)))
        _, served, any_served = self._selection
        return (served, None) if any_served else (None, self.whole_trees(num_draft_tokens))

    def _served_column(self, key: tuple) -> tuple:
        """Each row's params for the selection at ``key`` = (N, S), None where the round serves SGLang's own tree:
        per parameter set (requests share theirs: .request._interned), then mapped over the rows in C."""
        ids, of = by_id(self.params)
        cap = self.defaults.token_cap
        if cap is None:  # a set's rows are served alike, shared or not
            return tuple(map({i: _served(p, False, key, cap) for i, p in of.items()}.__getitem__, ids))
        served = {(i, s): _served(of[i], s, key, cap) for i, s in dict.fromkeys(zip(ids, self.shares))}
        return tuple(map(served.__getitem__, zip(ids, self.shares)))

    def drafted(self) -> tuple:
        """Each request's policy name (None: native), kept on each request (:data:`DRAFTED`: its stats are ours
        to keep) the first time: for every request, or, carried over from the last batch's, for the new ones."""
        if self.names is None:
            base = None if self._last is None else self._last[2]
            change = None if base is None else self._change()
            if change is not None:
                self.names = change.apply(base, lambda i, j: list(map(_name, self.params[i:j])))
                for i, j in change.fresh():
                    collections.deque(map(setattr, self.reqs[i:j], itertools.repeat(DRAFTED), self.names[i:j]),
                                      maxlen=0)
            else:
                ids, of = by_id(self.params)
                names = {i: None if p is None else policy_name(p) for i, p in of.items()}
                self.names = tuple(map(names.__getitem__, ids))
                collections.deque(map(setattr, self.reqs, itertools.repeat(DRAFTED), self.names), maxlen=0)  # in C
        return self.names

    def _change(self):
        """How this batch came from the last one (:func:`.batch_diff.diff`, None: rebuild), found once; its ids
        kept for the next change."""
        if self._last is None:
            return None
        held, ids, *_ = self._last
        change = diff(held, self.reqs, ids)
        if change is not None and change.old_ids is not None:
            self.ids = change.apply(change.old_ids, lambda i, j: map(id, self.reqs[i:j]))
        return change


def _name(p) -> Optional[str]:
    """A row's policy name for its stats (None: native)."""
    return None if p is None else policy_name(p)


def _served(p, shared: bool, key: tuple, token_cap) -> object:
    """A row's params for the selection at ``key`` = (N, S): None for a native row, and for one whose policy keeps
    SGLang's own tree there unless the token cap (on) may cut its tree (a sharing row keeps its selection)."""
    if p is None or (keeps_native_tree(p, *key) and (token_cap is None or not shared)):
        return None
    return p


_COLUMNS: List[Optional[BatchColumns]] = [None]  # the last batch's (one decode batch per scheduler process)


def _last_columns(reqs) -> Optional[BatchColumns]:
    """The last batch's columns when ``reqs`` are its requests, in order (an identity check in C), else None."""
    last = _COLUMNS[0]
    return last if last is not None and same_requests(reqs, last.reqs) else None


def batch_columns(reqs, defaults) -> BatchColumns:
    """The columns of the batch ``reqs`` (:class:`BatchColumns`): the last batch's when it holds the same
    requests, carried over from it when it had policies and changed by a few runs, else built."""
    last = _COLUMNS[0]
    if last is not None and same_requests(reqs, last.reqs) and last.defaults is defaults:
        return last
    key = tuple(reqs)
    if last is not None and last.any_policy and len(key) >= batch_diff.FEWEST and last.defaults is defaults:
        # a batch with policies that changed by a few runs (.batch_diff: its stats and selection ask for the
        # same change): every column carried over, the new requests' entries read
        change = diff(last.reqs, key, last.ids)
        if change is not None:
            fresh = {(i, j): [getattr(r, _ENTRY, None) or _entry(r, defaults) for r in key[i:j]]
                     for i, j in change.fresh()}
            params = change.apply(last.params, lambda i, j: [e[0] for e in fresh[i, j]])
            shares = change.apply(last.shares, lambda i, j: [e[1] for e in fresh[i, j]])
            cols = _COLUMNS[0] = BatchColumns(key, defaults, params, shares, any(map(operator.is_not, params, _NONES)),
                                              _last=(last.reqs, last.ids, last.names, last._selection))
            return cols
    entries = [getattr(r, _ENTRY, None) or _entry(r, defaults) for r in key]  # built: no policy, few, or reordered
    params, shares = (tuple(c) for c in zip(*entries)) if entries else ((), ())
    cols = _COLUMNS[0] = BatchColumns(key, defaults, params, shares, any(map(operator.is_not, params, _NONES)))
    return cols


_ENTRY = "_treespec_column"  # on a Req: (its parameters, whether it shares the token cap), resolved once
_NONES = itertools.repeat(None)


def _entry(req, defaults) -> tuple:
    """A request's ``(params, shares)`` (:func:`.server_hooks._req_params`: parsed once, on arrival), kept on the
    request: a batch that changes reads its members' entries, not their parameters again. A request with
    speculation off (``{"policy": "none"}``) verifies its root alone and shares nothing."""
    p = _req_params(req, defaults)
    entry = (p, p is not None and not isinstance(p, NoneParams) and _req_shares(req))
    try:
        setattr(req, _ENTRY, entry)
    except AttributeError:  # a slotted request type: resolved again next time
        pass
    return entry


def _policies(reqs) -> tuple:
    """``(reqs, names)``: each request's policy name, or None for a native request (or one never drafted with
    its policy). When ``reqs`` are the last batch's requests (an identity check in C), its columns' names and
    ``reqs`` as the tuple they hold (so the stats' own batch check is one of identity); else ``reqs`` and each
    request's own mark."""
    cols = _last_columns(reqs)
    if cols is not None:
        if not cols.any_policy:
            return cols.reqs, (None,) * len(reqs)  # no request of the batch has a policy: none was ever drafted
        if cols.names is not None:
            return cols.reqs, cols.names
    return reqs, [getattr(req, DRAFTED, None) or None for req in reqs]
