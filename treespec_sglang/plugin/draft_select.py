"""The per-request selection after SGLang's draft loop, whether it ran eagerly or as a CUDA graph replay.

SGLang captures its whole draft loop, ``organize_draft_results`` included, in one CUDA graph per batch
size; hooks do not run inside a replay. So the plugin leaves SGLang's loop as it is and works on its
output: ``organize_draft_results``' hook copies the candidate pool (scores, tokens, parent table) and SGLang's own
selection (``top_scores_index``) into a *stash*, one set of buffers per pool shape, and returns SGLang's
selection. In eager mode the copy runs every round; during capture it is recorded into the graph, so every
replay writes the pool into the same buffers. After the draft, :func:`select_after_draft` reads the stash (the
rows of this batch, cloned at the boundary as SGLang does for ``draft_probs``), runs every request's policy on it
(:func:`~.pool.select_on_pool`, sync-free) and hands ``build_eagle_verify_input`` the policy trees in
place of SGLang's ``top_scores_index`` / ``draft_tokens``. One code path on the CPU (eager) and the GPU
(replay).

The selection itself is the torch implementation (:func:`~.pool.select_on_pool`) or the same selection as one
fused Triton launch (:func:`~.pool_kernels.select_on_pool_fused`), per ``TREESPEC_SELECT``
(:func:`selection_mode`): ``auto`` (the default: on CUDA the kernel, replayed as a CUDA graph after a replayed
draft as ``graph`` does; torch elsewhere), ``torch``, ``triton`` (the kernel, launched), or ``graph``: the kernel,
and after a replayed draft its launch replayed as a CUDA graph of the draft's shape (:mod:`.select_graph`; an eager
draft launches it). Whichever selection runs, :func:`unlink` then takes the filler out of SGLang's verify chains
with the same choice: the fused kernel's one launch where the selection is the kernel, torch elsewhere.

Example: a graph captured for 8 rows replays a batch of 5 (SGLang pads to its bucket): the stash of
shape (8, P, W) holds 8 rows after the replay and the selection reads its first 5.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from .pool import BatchPlan, PoolView, policy_rows, select_on_pool, share_token_cap, unlink_filler, COLUMNS
from .pool_kernels import select_on_pool_fused, warm_up
from .classifiers import registered
from .rows import _clf_id
from .select_graph import graph_for
from .ranks import agree, perturbed, perturbed_parent_list, perturbed_rank, record_digest, verify_group
from .settings import derived, env
from .unlink_kernel import check_unlink, unlink_filler_fused

__all__ = ["stash_pool", "read_pool", "select_after_draft", "capturing", "ENV_SELECT", "selection_mode",
           "selection", "check_selection", "replays_selection", "capture_selections", "unlink"]

ENV_SELECT = "TREESPEC_SELECT"
SELECT_MODES = ("torch", "auto", "triton", "graph")

# (rows, P, W, device) -> (scores [rows, P] float32, tokens [rows, P] int64, parent_list [rows, W] int64)
_STASH: Dict[tuple, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
# the pool's stash key -> SGLang's own top_scores_index [rows, N-1] int64 on that pool, written beside it
_NATIVE: Dict[tuple, torch.Tensor] = {}
_CAPTURED: set = set()  # the stash keys a captured draft graph writes (kept for the process's life)


def capturing(t: Optional[torch.Tensor] = None) -> bool:
    """Whether the current CUDA stream (``t``'s, when given) is being captured into a CUDA graph (never on the
    CPU)."""
    if t is not None and not t.is_cuda:
        return False
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@derived
def selection_mode() -> str:
    """``TREESPEC_SELECT`` (the operator's environment): ``auto`` (unset), ``torch``, ``triton`` or ``graph``.

    Raises
    ------
    ValueError
        Naming the variable and the allowed values.
    """
    raw = env(ENV_SELECT)
    mode = raw.strip().lower() or "auto"
    if mode not in SELECT_MODES:
        raise ValueError(f"{ENV_SELECT} must be one of {list(SELECT_MODES)}, got {raw!r}")
    return mode


def selection(device) -> Callable:
    """The selection for a pool on ``device`` of an eager draft: :func:`~.pool.select_on_pool` (``torch``; ``auto``
    off CUDA) or :func:`~.pool_kernels.select_on_pool_fused` (``auto`` on CUDA; ``triton`` and ``graph``
    anywhere, in Triton's interpreter on the CPU: slow, for tests). Both return the same trees (the kernel's
    docstring says where float32 order may differ)."""
    mode = selection_mode()
    if mode == "torch" or (mode == "auto" and torch.device(device).type != "cuda"):
        return select_on_pool
    return select_on_pool_fused


def replays_selection(device) -> bool:
    """Whether the selection after a *replayed* draft on ``device`` is replayed too (:mod:`.select_graph`):
    ``graph``, or ``auto`` on CUDA."""
    mode = selection_mode()
    return mode == "graph" or (mode == "auto" and torch.device(device).type == "cuda")


def capture_selections(topk: int, num_draft_tokens: int) -> int:
    """Right after SGLang captured its draft graphs (server start, every scheduler process): the selection graph
    (:func:`~.select_graph.graph_for`) of every stash shape a captured draft graph writes, with every registered
    classifier, so no round captures one. A capture synchronises the device and empties the allocator's caches
    (``torch.cuda.graph``): in a round, that stalled the first treespec batch of each batch-size bucket, on every
    rank. Returns how many graphs serve (none off CUDA, in chain mode or where the selection is not replayed)."""
    keys = sorted((k for k in _CAPTURED if k in _STASH), reverse=True)  # the largest first: the scratch they share
    if topk < 2 or not keys or not replays_selection(keys[0][3]):
        return 0
    ids = sorted({_clf_id(clf) for clf in registered().values()})  # ``default`` among them
    for key in keys:
        # a captured graph's first copies into these buffers were recorded, never run: they hold whatever the
        # graph pool held, and the graph's eager first launch reads SGLang's selection there as pool indices
        for t in _STASH[key] + ((_NATIVE[key],) if key in _NATIVE else ()):
            t.zero_()
        graph_for(_STASH[key], key, topk, num_draft_tokens, ids, _NATIVE.get(key))
    return len(keys)


def unlink(next_token: torch.Tensor, next_sibling: torch.Tensor, keep: torch.Tensor) -> None:
    """Take the filler (nodes outside ``keep``) out of SGLang's verify chains, in place.

    Parameters
    ----------
    next_token, next_sibling : ``[bs, N]`` int64, ``build_eagle_verify_input``'s ``retrieve_next_token`` /
        ``retrieve_next_sibling`` (rewritten in place)
    keep : ``[bs, N]`` bool, the round's kept nodes in verify order (closed under ancestors)

    The fused kernel (:func:`~.unlink_kernel.unlink_filler_fused`, one launch) where :func:`selection` is the
    kernel, else :func:`~.pool.unlink_filler` and two copies (35 ATen ops at N 8).
    """
    if selection(keep.device) is select_on_pool_fused:
        unlink_filler_fused(next_token, next_sibling, keep.contiguous())
        return
    nt, ns = unlink_filler(next_token, next_sibling, keep)
    next_token.copy_(nt)
    next_sibling.copy_(ns)


def check_selection(device, topk: int, steps: int, num_draft_tokens: int) -> str:
    """At server start (every scheduler process): the mode is valid and, when it takes the kernels, the selection
    kernel loads and compiles for the server's pool (:func:`~.pool_kernels.warm_up`; chain servers, topk 1, never
    select) and the unlink kernel for its N, checked against the torch unlink on fixed trees
    (:func:`~.unlink_kernel.check_unlink`; chain rounds unlink too); returns the mode. Raises ValueError /
    RuntimeError (or triton's compile error) with the reason instead of failing a first round."""
    mode = selection_mode()
    if selection(device) is select_on_pool_fused:
        if topk > 1:
            warm_up(device, topk, steps, num_draft_tokens)
        check_unlink(device, num_draft_tokens)
    return mode


def stash_pool(score_list, token_list, parents_list, native_top: Optional[torch.Tensor] = None) -> tuple:
    """Copy SGLang's pool into the stash of its shape (inside ``organize_draft_results``, eager or captured).

    Parameters
    ----------
    score_list : S tensors, ``[rows, 1, k]`` then ``[rows, k, k]``; token_list : ``[rows, k]`` then
        ``[rows, k*k]``; parents_list : S tensors, SGLang's parent table pieces (``[rows, k + 1]``, ``[rows, k]``).
    native_top : optional ``[rows, N-1]``, SGLang's own ``top_scores_index`` on that pool: stashed too (a
        replayed selection graph reads it there, :mod:`.select_graph`, instead of copying it each round).

    Returns
    -------
    The stash key ``(rows, P, W, device)``. The buffers are allocated once per key and never freed, so a
    captured graph's copies keep writing where :func:`read_pool` reads.
    """
    scores = torch.cat(score_list, dim=1).flatten(1)
    tokens = torch.cat(token_list, dim=1)
    rows, P = scores.shape
    parent_list = torch.cat(parents_list[:-1], dim=1) if len(parents_list) > 1 else \
        torch.full((rows, 1), -1, dtype=torch.long, device=scores.device)
    key = (rows, P, parent_list.shape[1], str(scores.device))
    if capturing(scores):
        _CAPTURED.add(key)  # a graph writes these buffers from now on: never freed
    bufs = _STASH.get(key)
    if bufs is None:
        _drop_eager_stashes()
        bufs = _STASH[key] = (torch.empty(rows, P, dtype=torch.float32, device=scores.device),
                              torch.empty(rows, P, dtype=torch.long, device=scores.device),
                              torch.empty(rows, parent_list.shape[1], dtype=torch.long, device=scores.device))
    bufs[0].copy_(scores)
    bufs[1].copy_(tokens)
    bufs[2].copy_(parent_list)
    if native_top is None:
        _NATIVE.pop(key, None)  # none beside this pool: a stashed one would be another pool's
        return key
    native = _NATIVE.get(key)
    if native is None or native.shape[1] != native_top.shape[1]:
        native = _NATIVE[key] = torch.empty(rows, native_top.shape[1], dtype=torch.long, device=scores.device)
    native.copy_(native_top)
    return key


def _drop_eager_stashes() -> None:
    """Free the stashes no captured graph writes, before a new shape is stashed: an eager draft's pool is read in
    its own round, so one of them at a time is enough (SGLang drafts eagerly above its largest captured batch:
    kept per batch size, they would pile up to GBs outside SGLang's memory budget)."""
    for key in [k for k in _STASH if k not in _CAPTURED]:
        del _STASH[key]
        _NATIVE.pop(key, None)


def _stash_of(rows: int, topk: int, steps: int, device) -> Tuple[tuple, Tuple[torch.Tensor, ...]]:
    """``(key, (scores [rows, P], tokens [rows, P], parent_list [rows, W]))``: the stash a ``rows``-row draft wrote."""
    P, W = topk + (steps - 1) * topk * topk, 1 + (steps - 1) * topk
    key = (rows, P, W, str(torch.device(device)))
    if key not in _STASH:
        raise RuntimeError(f"treespec: no draft pool of shape {key[:3]} was recorded; the draft CUDA graph must be "
                           f"captured with the plugin loaded (rows, P = k + (S-1)k^2, W = 1 + (S-1)k)")
    return key, _STASH[key]


def _stashed(rows: int, bs: int, topk: int, steps: int, device) -> Tuple[torch.Tensor, ...]:
    """This round's ``bs`` rows of the stash of a ``rows``-row draft, cloned (scores, tokens, parent_list)."""
    return tuple(t[:bs].clone() for t in _stash_of(rows, topk, steps, device)[1])


def read_pool(rows: int, bs: int, topk: int, steps: int, device) -> PoolView:
    """The pool of this round's ``bs`` requests from the stash of a ``rows``-row draft (``rows >= bs``: a
    replayed graph's padded batch), cloned so a later replay cannot overwrite it.

    Raises
    ------
    RuntimeError
        If no draft loop of that shape wrote a pool (a graph captured before the plugin was loaded).
    """
    return PoolView.from_flat(*_stashed(rows, bs, topk, steps, device), topk)


def select_after_draft(step, rows: Optional[int], native_top: torch.Tensor, native_tokens: torch.Tensor,
                       num_draft_tokens: int, steps: int, parent_list: Optional[torch.Tensor] = None):
    """Every request's policy tree on this round's pool, agreed across the ranks that verify together.

    Parameters
    ----------
    step : the round's ``DraftStep`` (params, shares, token cap; ``step.keep`` is set here)
    rows : the replayed graph's batch size, or None when the draft ran eagerly (then ``bs``)
    native_top, native_tokens : ``[bs, N-1]`` SGLang's own ``top_scores_index`` / ``draft_tokens``
        (rows without a policy keep them verbatim)
    parent_list : ``[bs, W]`` int64, SGLang's parent table of the pool (``build_eagle_verify_input``'s), agreed
        with the rest: the tree's shape is built from it, and a rank whose draft beam went another way has another

    Returns
    -------
    ``(top_scores_index [bs, N-1], draft_tokens [bs, N-1], parent_list [bs, W] or None)`` for
    ``build_eagle_verify_input``.
    """
    bs, dev = native_top.shape[0], native_top.device
    group = verify_group()
    rows_t = policy_rows(step.params, dev, step.shares)  # cached per batch composition: no op, no list copy
    sizes = None  # [bs] keep.sum(-1) where the selection graph computed it
    if rows is not None and replays_selection(dev):  # a replayed draft: replay the selection's graph too
        top, tokens, keep, sizes = _select_replayed(step, rows, rows_t, native_top, num_draft_tokens, steps, group)
        scores = None  # [bs, P] the pool's, read from the stash only if the token cap needs them
    else:
        scores, tokens, pool_parent_list = _stashed(rows or bs, bs, step.topk, steps, dev)
        scores = perturbed([scores], group)[0]  # a no-op unless a test asks for a faulty rank
        pool = PoolView.from_flat(scores, tokens, pool_parent_list, step.topk)
        _, top, tokens, keep = selection(dev)(pool, num_draft_tokens, step.params, (None, native_top, native_tokens),
                                              rows_t)
    selected = keep  # what the graph's sizes count
    if step.token_cap is not None and any(step.shares):  # the token cap for the sharing requests
        if scores is None:  # a replay's: read where the stash holds them (before the next replay)
            scores = _stash_of(rows, step.topk, steps, dev)[1][0][:bs]
        keep = share_token_cap(scores, top, keep, rows_t[:, COLUMNS.index("shares")] > 0, step.token_cap)
    # every rank that verifies this batch takes rank 0's tree, its shape included (one int64 broadcast; alone:
    # a no-op)
    if parent_list is None:
        own = (top, tokens, keep)
        top, tokens, keep = agreed = agree(own, group)
    else:
        own = (top, tokens, keep, perturbed_parent_list(parent_list, group))
        top, tokens, keep, parent_list = agreed = agree(own, group)
    record_digest(own, agreed, group)
    step.selected(keep, sizes if keep is selected else None)  # a capped or agreed keep is counted anew
    return top, tokens, parent_list


def _select_replayed(step, rows: int, rows_t: torch.Tensor, native_top: torch.Tensor, num_draft_tokens: int,
                     steps: int, group):
    """``TREESPEC_SELECT=graph`` (or ``auto`` on CUDA) after a replayed draft: the selection graph of the draft's
    stash (:func:`~.select_graph.graph_for`) with this batch's rows; SGLang's own selection is read where the replay
    stashed it (``native_top`` is copied in only for a draft graph captured without that stash). Returns
    ``(top [bs, N-1], tokens [bs, N-1], keep [bs, N], sizes [bs])``, views of the graph's outputs."""
    bs, N = native_top.shape[0], num_draft_tokens
    key, stash = _stash_of(rows, step.topk, steps, native_top.device)
    if perturbed_rank(group):  # a test-only faulty rank: its own scores in the stash
        scores = stash[0][:bs]
        scores.copy_(perturbed([scores], group)[0])
    plan = BatchPlan.of(step.params, N, steps)
    extra = None
    if "custom" in plan.stages:  # the custom rules' own keep, computed on the host as select_on_pool does
        pool = PoolView.from_flat(*(t[:bs] for t in stash), step.topk)
        extra = plan.custom_keep(pool, rows_t, N)
    native = _NATIVE.get(key)  # SGLang's selection as the replay wrote it beside the pool
    if native is not None and native.shape[1] != N - 1:
        native = None
    graph = graph_for(stash, key, step.topk, N, plan.clf_ids, native)
    top, tokens, keep, sizes = graph.run(rows_t, None if native is not None else native_top, extra)
    return top, tokens, keep, sizes
