"""One speculative round as five stages over one :class:`Batch`: draft -> plan -> verify -> commit -> record.

``SpecEngine._round`` calls them in that order (gpt-fast's ``speculative_decode`` shape); each stage can be read
alone, and takes the engine's model calls (:class:`~treespec_sglang.engine.calls.ModelCalls`), not the engine. Positions follow :mod:`treespec_sglang.engine.engine`: request b's root sits at slot ``lens[b]``, a tree
node of depth d at ``lens[b] + d``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch

from ..policies import grow_tree
from ..policies.calibration import DepthCalibration
from ..tree import DraftTree, dense_mask, to_grid
from ..verify import emitted_tokens, verify_tree, walk_greedy
from ..verify.sampling import is_greedy
from .calls import ModelCalls
from .token_cap import AutoTokenCap, plan_round
from .expander import EntropyRecorder, TreeExpander
from .kv_cache import KVCache

__all__ = ["Batch", "RoundOptions", "draft", "plan", "verify", "commit", "record"]


@dataclass
class Batch:
    """The running requests' state between rounds (row b = the b-th running request)."""

    cache: KVCache  # the target's KV
    dcache: KVCache  # the draft's KV
    root: torch.Tensor  # [bs] int64, the last committed token (not yet verified)
    lens: torch.Tensor  # [bs] int64, committed tokens before the root
    f_root: torch.Tensor  # [bs, hidden] the root's draft feature
    root_lp: torch.Tensor  # [bs, vocab_d] the root's draft log-probs
    lens_host: List[int]  # lens on the host: max() sizes attention without a sync

    def select(self, keep: List[int], device) -> None:
        """Keep only rows ``keep`` (finished requests leave)."""
        k = torch.tensor(keep, device=device)
        self.cache.select(k)
        self.dcache.select(k)
        self.root, self.lens, self.f_root, self.root_lp = self.root[k], self.lens[k], self.f_root[k], self.root_lp[k]
        self.lens_host = [self.lens_host[i] for i in keep]


@dataclass(frozen=True)
class RoundOptions:
    """How the batch verifies this round: sampling, the batch's token cap (optional) and its calibration."""

    sampling: dict  # temperature / top_k / top_p (verify_tree's keywords)
    generator: torch.Generator
    token_cap: Optional[Union[int, AutoTokenCap]] = None  # tokens the batch verifies (None: every whole tree)
    calibration: Optional[DepthCalibration] = None
    shares: Optional[List[bool]] = None  # per request: its tree joins the token cap
    observer: Optional[Callable] = None  # observer(tree, parent_entropy, result) after the verify (C2T data)


def draft(m: ModelCalls, b: Batch, params, opts: RoundOptions) -> Tuple[DraftTree, TreeExpander, Optional[EntropyRecorder]]:
    """Grow every request's tree with its own policy (one draft forward per step for the batch).

    With an ``"auto"`` token cap that prunes, a sharing request's frontier nodes below the marginal value are
    not expanded (``min_logprob``; a request that opted out is never pruned)."""
    bs = b.root.shape[0]
    min_lp = None  # [bs]
    if isinstance(opts.token_cap, AutoTokenCap) and opts.token_cap.min_prob > 0:
        share = torch.tensor([True] * bs if opts.shares is None else opts.shares, device=m.device)
        min_lp = torch.where(share, math.log(opts.token_cap.min_prob), float("-inf"))
    expand = TreeExpander(m, b.dcache, b.lens, b.f_root, max(b.lens_host), ragged=min_lp is not None)
    recorder = EntropyRecorder(expand, b.root_lp) if opts.observer is not None else None
    tree = grow_tree(params, b.root, b.root_lp, recorder or expand, validate=False,  # log_softmax inputs
                     min_logprob=min_lp)
    return tree, expand, recorder


def plan(m: ModelCalls, tree: DraftTree, opts: RoundOptions) -> Tuple[DraftTree, Optional[torch.Tensor]]:
    """Keep the best nodes under the token cap (``rows``: ``[T]`` flat rows of the kept nodes, for a ragged
    verify; None without a cap) and map draft ids to target ids (a reduced draft vocabulary)."""
    rows = None
    if opts.token_cap is not None:
        tree, rows = plan_round(tree, opts.token_cap, opts.calibration, opts.shares)
    if m.token_map is not None:
        tree = dataclasses.replace(tree, tokens=m.to_target_ids(tree.tokens, (tree.parents < 0)))
    return tree, rows


def verify(m: ModelCalls, b: Batch, tree: DraftTree, rows: Optional[torch.Tensor], opts: RoundOptions):
    """One target forward over every tree (tree attention on the per-request cache), then the accepted path.

    -> (target states ``[bs, n_nodes, hidden]`` (EAGLE-3: ``[.., 4 * hidden]``), ``VerifyResult``). With ``rows``
    the target runs on the kept nodes only and the states go back to the grid (padding rows zero: never on an
    accepted path)."""
    bs, n, dev = b.root.shape[0], tree.n_nodes, m.device
    slots = b.lens[:, None] + torch.arange(n, device=dev)
    kv = max(b.lens_host) + n
    col = torch.arange(kv, device=dev)[None, None, :]
    rel = col - b.lens[:, None, None]  # column relative to the root's slot
    dense = dense_mask(tree)  # [bs, n_nodes, n_nodes]
    in_tree = torch.gather(dense, 2, rel.clamp(0, n - 1).expand(bs, n, kv)) & (rel >= 0) & (rel < n)
    mask = (rel < 0) | in_tree
    positions = b.lens[:, None] + tree.depth.clamp(min=0)
    stores = b.cache.stores(slots, kv)
    if rows is None:
        hidden = m.target(tree.tokens.clamp(min=0), positions, stores, mask)
        return hidden, verify_tree(tree, m.logits(hidden), generator=opts.generator, validate=False, **opts.sampling)
    flat = m.target(tree.tokens.clamp(min=0), positions, stores, mask, rows=rows)  # [T, hidden]
    lf = m.logits(flat)  # [T, vocab]
    hidden = to_grid(flat, rows, bs, n)  # padding rows zero
    temp = opts.sampling["temperature"]
    if is_greedy(temp):
        # the greedy walk reads argmaxes only: no [bs, n, vocab] grid (padding rows: 0, never read)
        return hidden, walk_greedy(tree, to_grid(lf.argmax(-1), rows, bs, n))
    return hidden, verify_tree(tree, to_grid(lf, rows, bs, n), generator=opts.generator, validate=False,
                               **opts.sampling)


def commit(m: ModelCalls, b: Batch, tree: DraftTree, result, hidden: torch.Tensor) -> torch.Tensor:
    """Keep the accepted path's KV at consecutive slots after the prefix, feed the draft the committed pairs
    with the target's real states (EAGLE's draft extend) and move ``b`` to the next round.

    -> the emitted tokens ``[bs, depth + 1]`` (accepted path then bonus, -1 padded).
    Example: lens 10, path [0, 2, 5] (root, then nodes 2 and 5) -> slots 10, 12, 15 move to 10, 11, 12."""
    em = emitted_tokens(tree, result)  # [bs, depth + 1]
    bs, D1 = result.path.shape
    j = torch.arange(D1, device=m.device)
    dst = b.lens[:, None] + j
    src = torch.where(result.path >= 0, b.lens[:, None] + result.path, dst)
    b.cache.compact(src, dst)
    # draft extend: (h_root, a_1), ..., (h_{a_k}, bonus)
    feats = torch.gather(hidden, 1, result.path.clamp(min=0)[:, :, None].expand(bs, D1, hidden.shape[-1]))
    n_acc = result.num_accepted
    b.f_root, b.root_lp = m.draft_extend(b.dcache, em.clamp(min=0), feats, b.lens + 1, n_acc + 1,
                                         kv=max(b.lens_host) + 1 + D1)
    b.root, b.lens = result.bonus, b.lens + 1 + n_acc
    return em


def record(b: Batch, stats, em: torch.Tensor, result, tree: DraftTree, expand: TreeExpander) -> List[List[int]]:
    """The round's one host read: each request's committed tokens (accepted + bonus), its counters and
    ``b.lens_host``."""
    host = torch.cat([em, result.num_accepted[:, None], tree.size[:, None]], dim=1).tolist()  # the one sync
    pending = []
    for s, row in zip(stats, host):
        k, size = row[-2], row[-1]
        s.rounds += 1
        s.draft_forwards += expand.calls + 1
        s.accepted.append(k)
        s.tree_sizes.append(size)
        pending.append(row[:k + 1])
    b.lens_host = [x + len(p) for x, p in zip(b.lens_host, pending)]
    return pending
