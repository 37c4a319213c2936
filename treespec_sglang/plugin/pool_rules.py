"""Each policy's rule applied directly to SGLang's draft pool, vectorised over requests (no sglang import).

SGLang's beam (topk k, steps S) leaves a pool of P = k + (S-1)k^2 candidates in fixed levels: level 1
is flat 0..k-1 (the root's children), level d >= 2 is the block of k^2 nodes at ``k + (d-2)k^2``, and
every run of k consecutive flat indices shares one parent. So a policy over the pool never needs a
walk: the level-wise policies (TALON, C2T, chain) take S masked steps over static slices, and SALF's
best-first search takes a number of masked pops bounded from the pool's own mass (:func:`salf_pops`).
Every step is a fixed sequence of tensor ops on ``[bs, P]`` masks: no host read, no Python branch on a
tensor value, the same op count for any batch size, graph-capturable.

Rows carry their parameters as columns of a ``[bs, F]`` float32 table (:mod:`.pool`); a rule computes
its keep mask for every row and the caller picks, per row, the rule of the row's kind.

Example (k = 2, S = 3, P = 10): levels [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]; flat 2-3 are the children of
``parent_of[1]`` (the first node the beam expanded at step 1), 4-5 of the second, 6-7 and 8-9 of the
two nodes chosen at step 2.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..policies.classifier import entropy_topm
from ..utils.syncs import to_device

__all__ = ["static", "arange", "level_slices", "parent_entropy", "level_policies_keep", "salf_keep", "salf_pops"]

NEG_INF = float("-inf")


_STATIC: dict = {}


def static(key: tuple, device, build) -> torch.Tensor:
    """A constant index tensor, built once per (key, device) on the host and kept on the device:
    no host->device copy per round, and safe to use inside a CUDA graph capture."""
    k = (key, str(torch.device(device)))
    t = _STATIC.get(k)
    if t is None:
        t = _STATIC[k] = to_device(build(), device)
    return t


def arange(n: int, device) -> torch.Tensor:
    """``torch.arange(n)`` on ``device``, built once (:func:`static`)."""
    return static(("arange", n), device, lambda: torch.arange(n))


def _rank(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Descending rank of each entry, ties toward the lower column (``rank_desc`` with a cached
    ``slots = arange(width)``). ``[bs, w]`` -> ``[bs, w]`` int64. Example: [.5, .9, .5] -> [1, 0, 2]."""
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(1, order, slots.expand_as(order))


def flat_order_key(x: torch.Tensor) -> torch.Tensor:
    """An int64 key whose descending order is ``x``'s with ties toward the lower column, so ``topk`` on
    it picks exactly what a stable descending sort would. ``[bs, w]`` float32 -> ``[bs, w]`` int64.

    float32 bits read as int32 keep the order of non-negative values; a negative value's magnitude bits
    are flipped (``^ 0x7FFFFFFF``) so a larger magnitude ranks lower. The key is that ordinal times
    ``w + 1`` plus ``w - column``: equal values differ only in the column part.
    Example: [-1., -.5, -1.] -> ordinals [a, b, a] with b > a -> keys [a*4+3, b*4+2, a*4+1], so topk(2)
    gives columns [1, 0] (-0.5, then the first -1).
    """
    w = x.shape[-1]
    bits = x.contiguous().view(torch.int32)
    ordinal = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    return ordinal * (w + 1) + (w - arange(w, x.device))


def level_slices(k: int, P: int):
    """``[(level d, first flat, end flat)]`` for d = 1..S. Example: k 2, P 10 -> [(1,0,2), (2,2,6), (3,6,10)]."""
    out, d, start, width = [], 1, 0, k
    while start < P:
        out.append((d, start, start + width))
        d, start, width = d + 1, start + width, k * k
    return out


def parent_entropy(cond: torch.Tensor, k: int) -> torch.Tensor:
    """``[bs, P]`` conditional child log-probs -> ``[bs, P]`` entropy of each node's parent's k-slot
    distribution, the same for the k siblings: C2T Eq. 7 over what the pool holds (the k drafted children), not
    over the top 1000 the classifier was trained on (lower: docs/plugin.md, section 2).

    Example: k 2, cond log([.5, .25, .9, .1]) -> [H(.5, .25), H(.5, .25), H(.9, .1), H(.9, .1)].
    """
    bs, P = cond.shape
    return entropy_topm(cond.view(bs, P // k, k)).repeat_interleave(k, dim=1, output_size=P)


def level_policies_keep(val: torch.Tensor, valid: torch.Tensor, parent: torch.Tensor, k: int, n_eff: torch.Tensor,
                        cols: dict, kinds: dict, conf: Optional[torch.Tensor]) -> torch.Tensor:
    """TALON, C2T and chain over the pool, one masked step per level.

    Parameters
    ----------
    val : ``[bs, P]`` float32 log path probability of every pool node (-inf where not ``valid``).
    valid : ``[bs, P]`` bool, a positive probability.
    parent : ``[bs, P]`` int64 flat index of its parent (-1: the root).
    n_eff : ``[bs]`` int64 tree size cap, root included: ``min(budget, N)`` (chain: ``min(length + 1, N)``).
    cols : ``{"topk", "log_mu", "beta", "max_depth"}`` -> ``[bs]`` float32 columns of the row table.
    kinds : ``{"talon", "c2t", "chain"}`` -> ``[bs]`` bool, only for the kinds present (the others are not run).
    conf : ``[bs, P]`` C2T confidence of every pool node (C2T Eq. 8, the row's classifier), needed when
        c2t or an early-stopping chain is present.

    Returns
    -------
    ``[bs, P]`` bool, the kept pool nodes of the rows of these kinds (False elsewhere).

    TALON (App. A Alg. 2): level 1 keeps the root's top ``min(K, N - 1)`` children; level d keeps the
    children of level d-1 with ``p >= mu * max_d`` by path value within the remaining budget. C2T
    (App. A Alg. 1): the level's top-K by path value, then ``C_i >= beta``, then the top
    ``min(K, remaining)`` by confidence, for ``d <= max_depth``. Chain: the best child of the last node
    while ``d < n_eff`` (and ``C_i >= beta`` with an early stop; beta -1 when none).
    """
    bs, P = val.shape
    levels = level_slices(k, P)
    widths = [b - a for _, a, b in levels]
    # a level-d node's parent as a column of level d-1: parent - start(d-1) (k = 2: level 3 is 6..9,
    # its parents sit in level 2 at 2..5, so parent 5 -> column 3)
    prev_start = static(("prev_start", k, P), val.device, lambda: torch.tensor(
        [0] * widths[0] + [a for _, a, _ in levels[:-1] for _ in range(k * k)]))
    split = lambda x: torch.split(x, widths, dim=1)  # noqa: E731  one op, views per level
    vals, valids = split(val), split(valid)
    parents = split(parent - prev_start) if len(levels) > 1 else [None]
    n_eff = n_eff[:, None]
    topk = cols["topk"].long()[:, None]
    if "talon" in kinds:
        log_mu, is_talon = cols["log_mu"][:, None], kinds["talon"][:, None]
    if conf is not None:
        confs = split(conf)
        passed_all = split(conf >= cols["beta"][:, None])  # first pruning, C_i >= beta
    if "c2t" in kinds:
        max_depth, is_c2t = cols["max_depth"][:, None], kinds["c2t"][:, None]
    if "chain" in kinds:
        is_chain = kinds["chain"][:, None]
    slots = arange(max(widths), val.device)
    size = torch.ones(bs, 1, dtype=torch.int64, device=val.device)
    out, new = [], None
    for i, (d, a, b) in enumerate(levels):
        v, sl = vals[i], slots[:b - a]
        cand = valids[i] if d == 1 else valids[i] & torch.gather(new, 1, parents[i])
        remaining = n_eff - size  # [bs, 1]
        vc = torch.where(cand, v, NEG_INF)
        r_cand = _rank(vc, sl)  # [bs, w]
        new = None
        if "talon" in kinds:
            if d == 1:
                t = cand & (r_cand < torch.minimum(topk, remaining))
            else:
                gate = (v >= vc.amax(-1, keepdim=True) + log_mu) & cand  # the anchor m_d passes its own gate
                t = gate & (_rank(torch.where(gate, v, NEG_INF), sl) < remaining)
            new = t & is_talon
        if "c2t" in kinds:
            # stage 1: the level's top-K by joint probability; first pruning; stage 2 by confidence
            passed = (r_cand < topk) & passed_all[i] & (max_depth >= d) & cand
            c = passed & (_rank(torch.where(passed, confs[i], NEG_INF), sl) < torch.minimum(remaining, topk))
            c = c & is_c2t
            new = c if new is None else new | c
        if "chain" in kinds:
            c = (r_cand == 0) & (remaining > 0) & cand
            if conf is not None:
                c = c & passed_all[i]
            c = c & is_chain
            new = c if new is None else new | c
        out.append(new)
        size = size + new.sum(-1, keepdim=True)
    return torch.cat(out, dim=1)


def salf_pops(th_min: float, n_max: int, S: int) -> int:
    """Static bound on SALF's pops over a pool of S levels (no host read per round).

    Every pop that does not stop the search expands a set D with sum of path probabilities >= th
    (line 13), each node is popped once, and one level's paths hold probability <= 1, so at most
    ``S / th`` pops continue, then one stops; and at most ``2N + 2`` in any case (each continuing pop's best
    node stays in the final top N, so N pops continue at most: ``2N + 2`` is a loose margin on that). Rows with
    th = 0 are SALF's exact top-N (Thm. 2-3) and are taken from the ranking instead (:mod:`.pool`).
    Example: th 0.6, S 6 -> 11; th 0.05, S 6, N 48 -> 98.
    """
    cap = 2 * n_max + 2
    if th_min <= 0:
        return cap
    return min(cap, int(math.floor(S / th_min + 1e-6)) + 1)


def salf_keep(val: torch.Tensor, valid: torch.Tensor, level: torch.Tensor, parent: torch.Tensor,
              n_eff: torch.Tensor, cols: dict, rows: torch.Tensor, pops: int, n_max: int, b_max: int) -> torch.Tensor:
    """SALF (Alg. 2) over the pool with masks: Q, G and D are ``[bs, P]`` bool over pool nodes.

    Parameters
    ----------
    val : ``[bs, P]`` float32 log path probability (-inf where not ``valid``, ``[bs, P]`` bool).
    level : ``[P]`` int64 pool level (root's children 1); parent : ``[bs, P]`` int64 (-1 root).
    n_eff : ``[bs]`` int64 ``min(budget, N)``, the size of G's output (root included).
    cols : ``{"batch", "th", "max_depth"}`` -> ``[bs]`` float32.
    rows : ``[bs]`` bool, the rows that run the search (th > 0); the others get nothing.
    pops : static number of pop iterations (:func:`salf_pops`); a stopped row is frozen.
    n_max, b_max : static bounds on ``n_eff`` and on the rows' ``batch`` B.

    Returns
    -------
    ``[bs, P]`` bool: the top ``n_eff - 1`` popped nodes by path value (G's top N with the root).

    Q's capacity N (Alg. 2 line 2; the push at line 20) and pushing only a node's top N-1 children are left out: a
    node either drops has N better nodes that are popped no later than it would be, so it could never be in
    D (``pr > eps``) nor in the output, and D, the gains and the stop are the same without the cap.
    Example: with th 0.6 a pool whose root children hold .7 and .2 pops both (B >= 2), D = {.7, .2}
    (gain .9), pushes their children, and stops at the next pop whose D holds less than .6.
    """
    bs, P = val.shape
    ninf = torch.full_like(val, NEG_INF)
    n1 = (n_eff - 1)[:, None]
    max_depth = cols["max_depth"].long()[:, None]
    # a child may enter Q only under a node that may be expanded (depth < max_depth, line 12)
    child_ok = valid & (level[None, :] <= max_depth) & (level > 1)[None, :]  # the root's children: at the start
    gain_of = val.exp()  # D's members count toward the gain, those at max_depth too (they enter G, childless)
    th = cols["th"][:, None]
    live = (max_depth >= 1) & (n1 >= 1) & rows[:, None]  # [bs, 1]
    q = valid & (level == 1)[None, :] & live
    parent_c = parent.clamp(min=0)
    none = torch.zeros_like(q)
    g_val = ninf  # [bs, P] path values of the popped nodes (G without the root), -inf elsewhere
    b_max = max(1, min(P, b_max))
    slots = arange(b_max, val.device)
    slot_ok = slots[None, :] < cols["batch"].long()[:, None]  # [bs, b_max] the row's B pops
    kth = min(max(n_max - 1, 1), P)
    eps_at = (n1 - 1).clamp(0, kth - 1)  # G's N-th best, the root first, is popped rank N-2
    key = flat_order_key(val)  # [bs, P] int64: val's order, ties to the lower flat index (the policy's order)
    key_none = torch.full_like(key, torch.iinfo(torch.int64).min)
    for _ in range(pops):
        top_i = torch.where(q, key, key_none).topk(b_max, dim=-1).indices  # lines 5-9: pop the B best of Q
        pop = none.scatter(1, top_i, slot_ok) & q
        g_val = torch.where(pop, val, g_val)
        eps = torch.gather(g_val.topk(kth, dim=-1).values, 1, eps_at)  # lines 10-11 (-inf while |G| < N)
        D = pop & (val > eps)  # line 12
        live = live & ((D * gain_of).sum(-1, keepdim=True) >= th)  # line 13
        q = ((q ^ pop) | (torch.gather(D, 1, parent_c) & child_ok)) & live  # lines 14-20
    popped = g_val > NEG_INF
    return popped & (_rank(g_val, arange(P, val.device)) < n1)
