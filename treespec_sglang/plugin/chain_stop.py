"""C2T early stop for chain drafting (topk = 1) at large batch (C2T §5.4, App. I; no sglang import).

SGLang's chain draft loop runs S steps for every row. For rows whose policy is
``{"policy": "chain", "beta": ...}`` we capture the draft distribution of each step, score the
chain token it produced with the C2T classifier (joint probability so far, entropy of the
distribution over its top-1000, depth) and cut the row's chain at the first token scoring below
beta. The cut is a *mask-only* change (the tail is unlinked from the verify traversal), so every
TP rank runs the same kernels and collectives; the per-row lengths are broadcast from rank 0
(:mod:`.ranks`, as SGLang's ``spec_tp_sync`` does) so all ranks verify the same chains even if their draft
logits differ in the last bit.

The depth-1 token comes from the draft-extend step whose distribution the loop does not see,
so it is always kept; depths 2..S are scored.

What the stop reads of each draft step is two numbers per row, its top log-prob and the entropy of its top-1000
(:func:`record_step`), written into a *stash* (one pair of ``[rows, S-1]`` buffers per shape) by the hook on the
draft runner's forward inside SGLang's draft loop. The stop is decided after the loop from the stash
(:meth:`ChainStopper.cut`), so the same code serves an eager draft and a replay of SGLang's draft CUDA
graph: with ``TREESPEC_CHAIN_STOP_GRAPH=1`` the loop records the two numbers while its graph is captured, every
replay writes them, and C2T chain rounds replay the graph instead of drafting eagerly. That costs every chain
round of the server a log-softmax and a top-1000 per step, native rounds included, so it is off by default
(then a C2T chain round drafts eagerly, recording the same numbers) until it has been timed on a GPU. A round
whose rows set no beta (shorter chains, ``none``) reads no statistics: it keeps SGLang's draft graph either way.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ..policies.classifier import c2t_features, entropy_topm
from ..policies.params import ChainParams, NoneParams
from .config import env_switch
from .pool import _Classifiers
from .pool_rules import static
from .rows import COLUMNS, _clf_id, by_id, classifier_ids, policy_rows
from .ranks import agree
from .settings import derived

__all__ = ["ChainStopper", "cut_lengths", "row_limits", "depths", "positions", "keep_mask", "record_step",
           "chain_graph_enabled", "ENV_CHAIN_GRAPH", "ChainLoop", "chain_loop", "recording_loop"]

ENV_CHAIN_GRAPH = "TREESPEC_CHAIN_STOP_GRAPH"
# (rows, S - 1, device) -> (top log-prob [rows, S-1], top-m entropy [rows, S-1]) float32
_STASH: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}


@derived
def chain_graph_enabled() -> bool:
    """``TREESPEC_CHAIN_STOP_GRAPH`` (the operator's environment): 1 records the stop's step statistics inside
    SGLang's draft CUDA graph, so C2T chain rounds replay it; unset / 0: those rounds draft eagerly.

    Raises ValueError naming the variable and the allowed values."""
    return env_switch(ENV_CHAIN_GRAPH)


@dataclass
class ChainLoop:
    """A chain draft loop that records the stop's statistics: ``steps`` S, ``i`` the next loop step (0..S-2)."""

    steps: int
    i: int = 0


_LOOP: contextvars.ContextVar = contextvars.ContextVar("treespec_chain_loop", default=None)


@contextlib.contextmanager
def chain_loop(steps: int) -> Iterator[ChainLoop]:
    """Mark the enclosed draft loop (``EagleDraftWorker.draft_forward``) as recording its steps."""
    token = _LOOP.set(ChainLoop(steps))
    try:
        yield _LOOP.get()
    finally:
        _LOOP.reset(token)


def recording_loop() -> Optional[ChainLoop]:
    """The chain draft loop recording its steps in this thread, or None."""
    return _LOOP.get()


def record_step(logits: torch.Tensor, i: int, num_steps: int) -> None:
    """Draft step ``i``'s statistics into the stash (eager, or recorded into a graph being captured).

    ``logits`` ``[rows, vocab]``: the draft's logits of loop step i (they produce the chain token at depth i + 2);
    ``num_steps``: S. Writes column i of the ``(rows, S-1)`` buffers in place (allocated once per shape and never
    freed, so a captured graph's writes land where :meth:`ChainStopper.cut` reads)."""
    key = (logits.shape[0], num_steps - 1, str(logits.device))
    bufs = _STASH.get(key)
    if bufs is None:
        bufs = _STASH[key] = (torch.zeros(key[0], key[1], device=logits.device),
                              torch.zeros(key[0], key[1], device=logits.device))
    top, entropy = step_stats(logits)
    bufs[0][:, i].copy_(top)
    bufs[1][:, i].copy_(entropy)


def step_stats(logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[rows, vocab]`` draft logits of one loop step -> (its top log-prob ``[rows]``, the entropy of its
    top-1000 ``[rows]``): what the stop reads of a step."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.max(dim=-1).values, entropy_topm(lp)


class ChainStopper:
    """Per-row chain lengths from the draft's step-by-step distributions: a batch's constants (its rows' betas,
    lengths and classifiers), built once per decode batch (:class:`.columns.BatchColumns`); :meth:`cut` each round.

    Parameters
    ----------
    params : one policy per row (rows that are not ``chain`` with ``beta`` never stop early)
    num_steps : S, the captured chain length
    """

    def __init__(self, params: List, num_steps: int, device):
        self.num_steps = num_steps
        # each request's cached parameter row (:func:`.pool.policy_rows`: no host->device copy per round)
        self.rows = rows = policy_rows(params, torch.device(device))  # [bs, F]
        # the device as a tensor's (SGLang's worker says "cuda", its tensors are on "cuda:0"): the stash's key
        self.device = rows.device
        self.beta, self.max_len = row_limits(rows, num_steps)  # [bs] each
        sets = by_id(params)[1].values()  # each parameter set once: a batch's requests share theirs
        self.active = any((isinstance(p, ChainParams) and (p.beta is not None or p.length < num_steps))
                          or isinstance(p, NoneParams) for p in sets)
        # only rows with a beta read the loop's step statistics: without one the cut is the row's length alone,
        # and the round keeps SGLang's draft graph (and its loop computes nothing of ours)
        self.reads_steps = num_steps > 1 and any(isinstance(p, ChainParams) and p.beta is not None for p in sets)
        # every classifier of the early-stopping rows scores the batch, each row keeps its own (the default
        # classifier scores the other rows, against beta -1)
        self.clf_ids = classifier_ids(params) or [_clf_id(None)]
        self.classifiers = _Classifiers(self.clf_ids, rows[:, COLUMNS.index("clf")], self.device) \
            if self.reads_steps else None
        self._fixed: Dict[int, tuple] = {}  # n_nodes -> (keep, sizes) of a batch whose cut is its rows' lengths
        self.depth = depths(num_steps, self.device)  # [S-1]

    def cut(self, rows: Optional[int] = None) -> torch.Tensor:
        """``[bs]`` int64 each row's kept chain depth this round (0 = the root alone), from the loop's steps in the
        stash (:func:`record_step`): ``rows`` the replayed graph's padded batch, or None when the draft ran eagerly
        (this batch's own size).

        All S - 1 steps at once (C2T Eq. 6-8 features per depth d = 2..S: the joint probability of the chain to
        d, the entropy of step d's top-1000, d): a row keeps depth d iff every depth 2..d scored at least its beta
        and d <= its length. One classifier call per distinct classifier, whatever S.

        Raises RuntimeError when no draft loop of that shape recorded its steps (a draft graph captured without
        ``TREESPEC_CHAIN_STOP_GRAPH=1`` replayed for a C2T chain round)."""
        if not self.reads_steps:  # no row has a beta (or S = 1: no loop step): the cut is the rows' own lengths
            return self.max_len
        bs = self.max_len.shape[0]
        top, entropy = (t[:bs] for t in self.steps(rows))  # [bs, S-1] each; read before the next replay
        return cut_lengths(top, entropy, self.depth, self.classifiers, self.beta, self.max_len)

    def steps(self, rows: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The stash the draft loop of ``rows`` rows (None: this batch's size) recorded its steps into: ``(top
        log-prob, entropy)`` ``[rows, S-1]`` each. Raises RuntimeError when no loop of that shape recorded."""
        key = (rows or self.max_len.shape[0], self.num_steps - 1, str(self.device))
        if key not in _STASH:
            raise RuntimeError(f"treespec: no chain draft loop of shape {key[:2]} recorded its steps; a C2T chain "
                               f"round needs an eager draft or a draft graph captured with {ENV_CHAIN_GRAPH}=1")
        return _STASH[key]

    def fixed_keep(self, n_nodes: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """A batch whose cut reads no step (:attr:`reads_steps` False): ``(keep [bs, n_nodes] bool, sizes [bs])``
        from its rows' lengths alone, the same every round: built once per ``n_nodes``, read-only."""
        fixed = self._fixed.get(n_nodes)
        if fixed is None:
            keep = keep_mask(self.max_len, n_nodes)
            fixed = self._fixed[n_nodes] = (keep, keep.sum(-1))
        return fixed


def row_limits(rows: torch.Tensor, num_steps: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``rows`` ``[bs, F]`` (the row table) -> ``(beta [bs], max_len [bs] int64)``: each row's early-stop threshold
    (-1 where it has none: never stops) and its own length (budget = length + 1; 0 for speculation off; the
    captured S = ``num_steps`` for native rows)."""
    return rows[:, COLUMNS.index("beta")], (rows[:, COLUMNS.index("budget")] - 1).clamp(max=num_steps).long()


def depths(num_steps: int, device) -> torch.Tensor:
    """``[S-1]`` the scored chain depths 2..S, built once per S and device (:func:`.pool_rules.static`)."""
    return static(("depths", num_steps), device, lambda: torch.arange(2, num_steps + 1))


def cut_lengths(top: torch.Tensor, entropy: torch.Tensor, depth: torch.Tensor, classifiers, beta: torch.Tensor,
                max_len: torch.Tensor) -> torch.Tensor:
    """``[bs]`` int64 each row's kept chain depth from its draft loop's steps (C2T Eq. 6-8 features per depth d =
    2..S: the joint probability of the chain to d, the entropy of step d's top-1000, d): a row keeps depth d iff
    every depth 2..d scored at least its beta and d <= its length.

    ``top``, ``entropy`` ``[bs, S-1]`` the steps' top log-prob and top-1000 entropy; ``depth`` ``[S-1]`` the
    depths 2..S; ``classifiers`` ``[bs, S-1, 3] -> [bs, S-1]``; ``beta`` ``[bs]`` (-1: never stops);
    ``max_len`` ``[bs]`` int64 each row's own length."""
    bs = top.shape[0]
    feats = c2t_features(top.cumsum(dim=1), entropy, depth.expand(bs, -1))  # [bs, S-1, 3]
    ok = (classifiers(feats) >= beta[:, None]) & (depth[None, :] <= max_len[:, None])
    # the first failing depth ends the chain (depth 1 kept unless the row's length is 0: ``none``)
    return torch.minimum(1 + ok.long().cumprod(dim=1).sum(dim=1), max_len)


def keep_mask(length: torch.Tensor, n_nodes: int, group=None) -> torch.Tensor:
    """``length`` ``[bs]`` kept chain depths (:meth:`ChainStopper.cut`) -> ``[bs, n_nodes]`` bool: chain node i
    (0 = root) is kept iff i <= length, rank 0's lengths on every rank of ``group`` (a ``GroupCoordinator``:
    :func:`~treespec_sglang.plugin.ranks.agree`)."""
    (length,) = agree([length], group)
    return positions(n_nodes, length.device) <= length[:, None]


def positions(n_nodes: int, device) -> torch.Tensor:
    """``[1, n_nodes]`` int64 the chain's node positions 0..N-1 (root first), built once per N and device."""
    return static(("positions", n_nodes), device, lambda: torch.arange(n_nodes)[None, :])

