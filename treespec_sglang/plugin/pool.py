"""Per-request tree policies inside SGLang's captured EAGLE draft shape (no sglang import).

SGLang's draft loop (topk k, steps S, N verify tokens) expands a fixed beam and leaves a pool of
k + (S-1)k^2 candidates with cumulative scores (``select_top_k_tokens``); ``organize_draft_results``
then keeps the N-1 best. Here each request's policy chooses its own subset of that pool instead:

* no policy (None): SGLang's own top N-1 (native behaviour);
* ``none``: the root alone (speculation off for the request: plain decoding);
* ``eagle2``: the top ``min(budget, N) - 1`` by score (SALF with th = 0 too: its exact top-N, Thm. 2-3);
* ``talon`` / ``salf`` / ``c2t`` / ``chain``: the policy's own rule over the pool (:mod:`.pool_rules`);
  a policy registered with a ``"custom"`` pool rule, its own ``keep`` function
  (:mod:`treespec_sglang.policies.registry`: each policy's one registration names its stage and row):
  a pool node's children are exactly the ones SGLang's beam computed, with their true conditional draft
  probabilities, so the policy sees what the captured draft computed and is limited to the beam. Every
  policy's tree is capped at N nodes (its budget is ``min(budget, N)``).

The selection is padded back to exactly N-1 with SGLang's next-best nodes (the kernel needs N
per request) and :func:`unlink_filler` removes the padding from the verify traversal, so the
verified tree is exactly the policy's tree.

Per round the selection is sync-free: each request's parameters are one row of a device table
(:func:`request_row`, built once per distinct parameter set and reused while the request lives), the
rows are concatenated (one op) and every rule is a fixed sequence of tensor ops bounded by S, so the
same code runs eagerly or inside a CUDA graph and its op count does not grow with the batch.
"""

from __future__ import annotations

import collections

import copy
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ..policies.classifier import c2t_features, load_classifier
from ..policies.params import PolicyParams
from ..policies.registry import REGISTRY, pool_rule_of, registration_of
from ..policies.token_cap import select_best
from ..utils.bounded import Bounded
from .pool_rules import arange, level_policies_keep, parent_entropy, salf_keep, salf_pops, static
from .rows import (_C, _CLF_SPECS, COLUMNS, _row_values, _rule_row, by_id, classifier_ids, kind_id, per_batch,
                   policy_rows, request_row)

__all__ = ["PoolView", "select_from_pool", "select_on_pool", "share_token_cap", "unlink_filler", "request_row",
           "policy_rows", "kind_id", "COLUMNS", "BatchPlan", "classifier_ids", "per_batch", "keeps_native_tree",
           "first_child_parents"]

_LEVEL_STAGES = ("talon", "c2t", "chain")  # pool_rules.level_policies_keep's rules


class _Classifiers:
    """The batch's C2T classifiers as one ``[bs, m, 3] -> [bs, m]`` function: each distinct classifier
    scores the whole batch and every row takes its own (no per-round row index tensors)."""

    _ON_DEVICE: Dict[tuple, torch.nn.Module] = {}

    def __init__(self, ids: List[int], clf_col: torch.Tensor, device):
        self.mods = []
        for i in ids:
            key = (i, str(torch.device(device)))
            if key not in self._ON_DEVICE:  # a copy: Module.to moves in place, and the loaded one is shared
                self._ON_DEVICE[key] = copy.deepcopy(load_classifier(_CLF_SPECS[i])).to(device)
            self.mods.append((i, self._ON_DEVICE[key]))
        self.clf_col = clf_col

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = self.mods[0][1](feats)
            for i, m in self.mods[1:]:
                out = torch.where((self.clf_col == i)[:, None], m(feats), out)
            return out


class PoolView:
    """SGLang's draft pool for a batch (what ``select_top_k_tokens`` accumulated over S steps).

    Attributes
    ----------
    scores : ``[bs, P]`` cumulative path probabilities, P = k + (S-1)k^2, SGLang's flat order
    val : ``[bs, P]`` their logs, -inf where not a positive probability (``valid``)
    tokens : ``[bs, P]`` token ids
    parent_list : ``[bs, 1 + (S-1)k]`` SGLang's parent table (``parents_list[:-1]`` concatenated)
    parent : ``[bs, P]`` flat index of each node's parent, -1 for the root's children
        (SGLang's convention: ``parent_list[f // k]``)
    level : ``[P]`` depth of each flat index (root's children: 1)

    Examples
    --------
    k = 2, S = 3: step 0 gives flat 0-1 (root's children); step 1 expands both, children at
    2-3 (of 0) and 4-5 (of 1); step 2 expands the 2 best of 2-5, say [5, 2], children at 6-7
    (of 5) and 8-9 (of 2). parent_list = [-1, 0, 1, 5, 2], parent = [-1, -1, 0, 0, 1, 1, 5, 5, 2, 2].
    """

    def __init__(self, score_list, token_list, parents_list, topk: int):
        scores = torch.cat(score_list, dim=1).flatten(1)
        bs = scores.shape[0]
        parent_list = torch.cat(parents_list[:-1], dim=1) if len(parents_list) > 1 else \
            torch.full((bs, 1), -1, dtype=torch.long, device=scores.device)
        self._set(scores, torch.cat(token_list, dim=1), parent_list, topk)

    @classmethod
    def from_flat(cls, scores: torch.Tensor, tokens: torch.Tensor, parent_list: torch.Tensor, topk: int) -> "PoolView":
        """The pool from its flat tensors: ``scores`` / ``tokens`` ``[bs, P]``, ``parent_list`` ``[bs, 1 + (S-1)k]``."""
        view = cls.__new__(cls)
        view._set(scores, tokens, parent_list, topk)
        return view

    def _set(self, scores, tokens, parent_list, k):
        self.k = k
        self.scores = scores.float()
        self.tokens = tokens
        self.parent_list = parent_list
        bs, P = self.scores.shape
        self.level = _levels(k, P, scores.device)
        self.parent = torch.gather(self.parent_list.long(), 1, _group_index(k, P, scores.device).expand(bs, P))
        self.valid = self.scores > 0  # NaN / negative / zero: not a candidate for the policies
        self.val = torch.where(self.valid, self.scores.log(), float("-inf"))

    @property
    def steps(self) -> int:
        """S, the draft steps that built the pool (P = k + (S-1)k^2)."""
        return 1 + (self.scores.shape[1] - self.k) // (self.k * self.k)

    @property
    def parent_val(self) -> torch.Tensor:
        """``[bs, P]`` the parent's log path value (0 for the root)."""
        pv = torch.gather(self.val, 1, self.parent.clamp(min=0))
        return torch.where(self.parent < 0, 0.0, pv)


def _levels(k: int, P: int, dev) -> torch.Tensor:
    """``[P]`` int64 pool level of each flat index: k 2, P 10 -> [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]."""
    def build():
        f = torch.arange(P)
        return torch.where(f < k, 1, 2 + (f - k).div(k * k, rounding_mode="floor"))
    return static(("level", k, P), dev, build)


def _group_index(k: int, P: int, dev) -> torch.Tensor:
    """``[1, P]`` the parent-table column of each flat index, ``f // k``."""
    return static(("group", k, P), dev, lambda: (torch.arange(P) // k)[None, :])


def first_child_parents(k: int, steps: int) -> list:
    """A parent table of SGLang's layout (:attr:`PoolView.parent_list`, one row: ``1 + (steps - 1) k`` entries) for a
    draft of ``steps`` steps at top-k ``k`` whose beam expanded, at every step after the first, each expanded node's
    first child: a valid pool for any scores, where a pool of the server's shape is needed without a draft (the
    kernel's warm-up at server start, benchmarks). k = 2, steps = 3: ``[-1, 0, 1, 2, 4]``. At one step it is
    ``[-1, 0, ..., k-1]`` (1 + k entries, where SGLang's table is empty): every node then hangs off the root, and
    no entry is read."""
    return [-1] + list(range(k)) + [k + (i - 1) * k * k + j * k for i in range(1, steps - 1) for j in range(k)]


def keeps_native_tree(p: PolicyParams, N: int, S: int) -> bool:
    """Whether ``p``'s tree over SGLang's pool is SGLang's own at N verify tokens over S draft steps: a ranking rule
    (EAGLE-2, SALF with th = 0, Thm. 2-3) keeping at least the N-1 best pool nodes at every depth. EAGLE-2's
    reranking (EAGLE-2 §4.2) is what ``organize_draft_results`` runs, so such a request needs no selection of its
    own: it takes SGLang's verbatim, ties as SGLang breaks them."""
    keeps = _NATIVE_TREES.get((p, N, S))
    if keeps is None:  # once per parameter set and shape: a batch whose requests change asks for each of them
        v = _row_values(p, False)  # the row the selection reads (a rule's None: unbounded)
        keeps = _NATIVE_TREES.put((p, N, S), pool_rule_of(p).stage in ("rank", "salf") and v[_C["top"]] >= N - 1
                                  and v[_C["th"]] <= 0 and v[_C["rank_depth"]] >= S)
    return keeps


_NATIVE_TREES: Dict[tuple, bool] = Bounded(4096)  # (params, N, S) -> keeps_native_tree


def _carry_plan(entry: list, old_extra: tuple, old_params: tuple, change, params: tuple, key: tuple):
    """A changed batch's plan entry ``[plan, rows per parameter set]`` (:func:`per_batch`'s carry): the last
    batch's plan when the batch holds the same parameter sets (a plan reads sets, not rows), told from how many
    rows hold each (counted once, then carried: the rows that left taken off, the new ones added); None (planned
    again) when a set is new or none of its rows is left."""
    plan, counts = entry
    if old_extra != key:
        return None
    counts = dict(collections.Counter(map(id, old_params)) if counts is None else counts)
    for run in change.removed(old_params):
        for p in run:
            counts[id(p)] -= 1
    for i, j in change.fresh():
        for p in params[i:j]:
            n = counts.get(id(p))
            if n is None:
                return None
            counts[id(p)] = n + 1
    return None if 0 in counts.values() else [plan, counts]


def _rows_of(kind: torch.Tensor, names) -> torch.Tensor:
    """``[bs]`` bool: the rows whose ``kind`` column is one of the policies ``names``."""
    ids = sorted(kind_id(n) for n in names)
    out = kind == ids[0]
    for i in ids[1:]:
        out = out | (kind == i)
    return out


@dataclass(frozen=True)
class BatchPlan:
    """What a selection reads of a batch's ``params`` on the host, in one pass (the torch path and the fused
    kernel alike): ``stages`` pool stage -> its policies' names (``"native"``: rows without a policy);
    ``clf_ids`` :func:`classifier_ids`; ``mask_depth`` SGLang's ranking is depth-masked for some row (its
    ``rank_depth`` column: SALF with th = 0 never goes below its max_depth; every other row is unbounded, so
    the mask is a row's own and a batch's other rows never change it); ``salf`` the search's static bounds
    ``(pops, n_max, b_max)`` (:func:`.pool_rules.salf_pops`) when a SALF row has th > 0, else None."""

    stages: Dict[str, set]
    clf_ids: List[int]
    mask_depth: bool
    salf: Optional[tuple]

    @classmethod
    def of(cls, params, N: int, S: int) -> "BatchPlan":
        """The plan of ``params`` for N verify tokens over S draft steps, kept per batch composition
        (:func:`per_batch`), and carried over a changed batch that holds the same parameter sets."""
        return per_batch("plan", params, (N, S), lambda: [cls._of(params, N, S), None],
                         lambda *last: _carry_plan(*last, params, (N, S)))[0]

    @classmethod
    def _of(cls, params, N: int, S: int) -> "BatchPlan":
        stages: Dict[str, set] = {}
        mask_depth, salf = False, []
        params = tuple(by_id(params)[1].values())  # each parameter set once (a plan reads sets, not rows)
        for p in params:
            if p is None:
                stages.setdefault("native", set()).add("native")
                continue
            stage, row = pool_rule_of(p).stage, _rule_row(p)
            stages.setdefault(stage, set()).add(registration_of(p).name)
            mask_depth |= row.get("rank_depth") is not None and row["rank_depth"] < S
            if stage == "salf" and row["th"] > 0:
                salf.append((p.max_nodes, row["th"], row["batch"]))
        bounds = (salf_pops(min(t for _, t, _ in salf), N, S), min(N, max(n for n, _, _ in salf)),
                  max(b for _, _, b in salf)) if salf else None
        return cls(stages, classifier_ids(params), mask_depth, bounds)

    def custom_keep(self, pool: "PoolView", rows: torch.Tensor, N: int) -> Optional[torch.Tensor]:
        """``[bs, P]`` bool: the custom-rule policies' own ``keep`` (each given the rows' tree size cap
        ``min(budget, N)``), each on its rows only (None: no such row)."""
        names = sorted(self.stages.get("custom", ()))
        if not names:
            return None
        n_eff = rows[:, _C["budget"]].clamp(max=N).long()  # [bs] tree size cap, root included
        out = None
        for name in names:
            part = REGISTRY[name].pool_rule.keep(pool, rows, n_eff) & _rows_of(rows[:, _C["kind"]], {name})[:, None]
            out = part if out is None else out | part
        return out


def select_from_pool(score_list, token_list, parents_list, num_draft_token: int, topk: int,
                     params: Sequence[Optional[PolicyParams]], native=None, rows: Optional[torch.Tensor] = None):
    """``organize_draft_results`` with per-request policies.

    Parameters
    ----------
    score_list, token_list, parents_list, num_draft_token : as SGLang passes them
    topk : the server's ``speculative_eagle_topk``
    params : one policy per request (None = SGLang's own selection); read on the host only to know
        which rules and classifiers the batch needs
    native : optional ``(parent_list, top_scores_index, draft_tokens)`` from SGLang's function;
        rows without a policy take it verbatim (exact native behaviour, ties included)
    rows : optional ``[bs, F]`` float32 row table (:func:`policy_rows`); built from ``params`` if not given

    Returns
    -------
    (parent_list, top_scores_index ``[bs, N-1]``, draft_tokens ``[bs, N-1]``, keep ``[bs, N]`` bool)
        As SGLang returns them, plus ``keep[b, i]``: verify node i (0 = root) is part of
        request b's policy tree (the rest is filler, unlinked by :func:`unlink_filler`).

    Examples
    --------
    Two rows, k 2, S 2, N 4: a native row keeps SGLang's top 3; ``{"policy": "none"}`` keeps the root alone.

    >>> from treespec_sglang.policies import parse_spec
    >>> sl = [torch.tensor([[[.6, .3]], [[.6, .3]]]), torch.tensor([[[.5, .1], [.2, .1]]] * 2)]
    >>> tl = [torch.tensor([[1, 2]] * 2), torch.tensor([[3, 4, 5, 6]] * 2)]
    >>> pl = [torch.tensor([[-1, 0, 1]] * 2), torch.tensor([[2, 3]] * 2)]
    >>> keep = select_from_pool(sl, tl, pl, 4, 2, [None, parse_spec({"policy": "none"})])[3]
    >>> keep.tolist()
    [[True, True, True, True], [True, False, False, False]]
    """
    pool = PoolView(score_list, token_list, parents_list, topk)
    return select_on_pool(pool, num_draft_token, params, native, rows)


def select_on_pool(pool: PoolView, num_draft_token: int, params: Sequence[Optional[PolicyParams]], native=None,
                   rows: Optional[torch.Tensor] = None):
    """:func:`select_from_pool` on a :class:`PoolView` (the pool read back after the draft loop)."""
    N = num_draft_token
    topk = pool.k
    bs, P = pool.scores.shape
    dev = pool.scores.device
    if rows is None:
        rows = policy_rows(params, dev)
    plan = BatchPlan.of(params, N, pool.steps)
    stages = plan.stages
    kind = rows[:, _C["kind"]]
    n_eff = rows[:, _C["budget"]].clamp(max=N).long()  # [bs] tree size cap, root included
    limit = rows[:, _C["top"]].clamp(max=N - 1).long()  # [bs] nodes kept by SGLang's ranking
    ar = arange(P, dev)
    # SGLang's ranking, ties toward the earlier (shallower) candidate; sorted position j < limit <=> rank < limit
    rank_scores, shallow = pool.scores, None
    if plan.mask_depth:
        shallow = pool.level[None, :] <= rows[:, _C["rank_depth"], None]  # [bs, P]
        rank_scores = torch.where(shallow, rank_scores, float("-inf"))
    order = torch.sort(rank_scores, dim=-1, descending=True, stable=True).indices  # [bs, P]
    keep = torch.zeros(bs, P, dtype=torch.bool, device=dev).scatter(1, order, ar[None, :] < limit[:, None])
    if shallow is not None:  # fewer shallow candidates than the cut: the masked (deeper) ones stay out
        keep = keep & shallow
    cols = {c: rows[:, _C[c]] for c in ("topk", "log_mu", "beta", "max_depth", "th", "batch")}
    kinds = {stage: _rows_of(kind, stages[stage]) for stage in _LEVEL_STAGES if stage in stages}
    if kinds:
        conf = None
        if plan.clf_ids:  # every node's C2T features and confidence at once (C2T Eq. 6-8)
            feats = c2t_features(pool.val, parent_entropy(pool.val - pool.parent_val, topk), pool.level.expand(bs, P))
            conf = _Classifiers(plan.clf_ids, rows[:, _C["clf"]], dev)(feats)  # [bs, P]
        keep = keep | level_policies_keep(pool.val, pool.valid, pool.parent, topk, n_eff, cols, kinds, conf)
    if plan.salf is not None:  # the best-first search (th = 0 rows took their exact top-N from the ranking)
        search = cols["th"] > 0  # SALF's column: only rows of the salf stage set it
        keep = keep | salf_keep(pool.val, pool.valid, pool.level, pool.parent, n_eff, cols, search, *plan.salf)
    custom = plan.custom_keep(pool, rows, N)  # a registered policy's own rule, on its rows only
    if custom is not None:
        keep = keep | custom
    # pad to exactly N-1 with the best unselected candidates: a prefix of SGLang's ranking, which is
    # closed under ancestors because a parent never scores below its child
    need = (N - 1) - keep.sum(-1, keepdim=True)
    unsel = ~torch.gather(keep, 1, order)
    fill = torch.zeros_like(keep).scatter(1, order, unsel & (unsel.cumsum(-1) <= need))
    idx = torch.where(keep | fill, ar, P)
    # a column slice is a strided view: SGLang's tree kernel takes [bs, N-1] contiguous int64 only
    top_scores_index = torch.sort(idx, dim=-1).values[:, :N - 1].contiguous()
    node_keep = torch.cat([torch.ones(bs, 1, dtype=torch.bool, device=dev),
                           torch.gather(keep, 1, top_scores_index)], dim=1)
    if native is not None and None in params:
        is_native = (kind == kind_id("native"))[:, None]
        top_scores_index = torch.where(is_native, native[1], top_scores_index)
        node_keep = node_keep | is_native
    draft_tokens = torch.gather(pool.tokens, 1, top_scores_index)
    return pool.parent_list, top_scores_index, draft_tokens, node_keep


def share_token_cap(scores: torch.Tensor, top_scores_index: torch.Tensor, keep: torch.Tensor,
                    shares: torch.Tensor, per_request: int) -> torch.Tensor:
    """The batch's token cap for its sharing requests, on SGLang's verify layout.

    Parameters
    ----------
    scores : ``[bs, P]`` the pool's cumulative path probabilities (:class:`PoolView`).
    top_scores_index : ``[bs, N-1]`` pool index of verify nodes 1..N-1 (ascending: parents first).
    keep : ``[bs, N]`` bool, each request's own policy tree (:func:`select_from_pool`).
    shares : ``[bs]`` bool, the requests that share the token cap (the others keep their tree whole).
    per_request : mean verified tokens per sharing request (roots included).

    Returns
    -------
    ``[bs, N]`` bool: the sharing requests' ``(per_request - 1) * n_sharing`` best non-root nodes of the
    batch by path probability, within their own trees; ancestor-closed (a child's cumulative score never
    exceeds its parent's and a parent has the smaller column); other rows as given.

    Example: two sharing rows with node scores [.9, .8, .1] and [.3, .2, .1] (all kept), per_request 3:
    4 nodes go to the batch's best, .9 .8 .3 .2 -> keep [[T, T, T, F], [T, T, T, F]].
    """
    bs, N = keep.shape
    col = torch.arange(N, device=keep.device).expand(bs, N)
    vals = torch.cat([torch.full((bs, 1), float("inf"), device=scores.device),
                      torch.gather(scores, 1, top_scores_index)], dim=1)  # [bs, N] root: +inf
    pool_rows = shares[:, None] & (col >= 1)  # [bs, N] the nodes the token cap decides on
    left = (per_request - 1) * shares.long().sum()  # non-root tokens of the sharing rows
    chosen = select_best(vals, col, keep & pool_rows, left)
    return (keep & ~pool_rows) | chosen


def unlink_filler(next_token: torch.Tensor, next_sibling: torch.Tensor, keep: torch.Tensor):
    """Remove non-kept (filler) nodes from SGLang's first-child / next-sibling chains.

    ``[bs, N]`` int64 chains, ``[bs, N]`` bool keep -> new chains: a kept node's first child becomes
    its first *kept* child and its next sibling the next *kept* sibling; fillers get -1. The kept
    set is closed under ancestors, so no kept node hangs below a filler.

    Example: the root's children 1 -> 2 -> 3 (sibling chain), keep = {0, 1, 3}:
    next_token[0] = 1, next_sibling[1] = 3.
    """
    bs, N = keep.shape
    ar = torch.arange(N, device=keep.device)
    # J[x] = first kept node on x's sibling chain starting at x (pointer jumping, log2 N rounds)
    J = torch.where(keep, ar[None, :], next_sibling)
    for _ in range(max(N, 2).bit_length()):
        J = torch.where(J >= 0, torch.gather(J, 1, J.clamp(min=0)), J)

    def skip(ptr):
        return torch.where(ptr >= 0, torch.gather(J, 1, ptr.clamp(min=0)), -1)

    return torch.where(keep, skip(next_token), -1), torch.where(keep, skip(next_sibling), -1)
