"""The C2T chain cut as one CUDA graph per replayed chain draft shape (no sglang import).

In chain mode (topk 1) a C2T row stops its chain at the first depth its classifier scores below its beta
(:mod:`.chain_stop`). After a replay of SGLang's draft graph captured recording the loop's steps
(``TREESPEC_CHAIN_STOP_GRAPH=1``), the steps are in a stash of the replay's shape ``(rows, S-1)``; the cut read
from it is some 30 small ops (the features, each classifier's two layers, the running product, the mask), ~30
launches and their host time every round. A :class:`CutGraph` is that cut, and the keep mask and tree sizes
after it, captured once per stash shape and N with static inputs and outputs, as :mod:`.select_graph` captures the
selection:

1. ``run`` copies the batch's row table into rows ``[:bs]`` of the graph's (one op, none when the batch's
   table is the one the previous round wrote: a steady batch's stopper keeps its own; the padding rows stay
   native: a full chain, never scored below -1);
2. one replay: :func:`.chain_stop.cut_lengths` over the stash, the keep mask, the sizes;
3. the first ``bs`` rows of the outputs, as views (every reader is queued on the same stream before the next
   replay, as with the selection's).

A server captures these graphs at start, right after SGLang's draft graphs (:func:`capture_cuts`). Off CUDA the
same static-buffer body runs uncaptured (one code path; the CPU tests check what a replay computes). A round with
no C2T row reads no step and needs no graph: its cut is its rows' own lengths, the same every round
(:meth:`.chain_stop.ChainStopper.fixed_keep`).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from .chain_stop import (_STASH, ChainStopper, chain_graph_enabled, cut_lengths, depths, keep_mask, positions,
                         row_limits)
from .classifiers import registered
from .draft_select import replays_selection
from .pool import _Classifiers
from .ranks import group_size
from .rows import COLUMNS, _clf_id
from .select_graph import StaticRows, captured

__all__ = ["CutGraph", "cut_graph_for", "chain_keep", "capture_cuts", "CUT_GRAPHS"]

# (stash key (rows, S-1, device), N) -> the graph serving it (classifier ids grow by recapture, never shrink)
CUT_GRAPHS: Dict[tuple, "CutGraph"] = {}
_CLF = COLUMNS.index("clf")


class CutGraph:
    """The chain cut over one stash shape with static inputs and outputs, captured on CUDA.

    Parameters
    ----------
    steps : ``(top log-prob, entropy)`` ``[rows, S-1]`` float32 each, the buffers the draft loop's replay writes
        (:func:`.chain_stop.record_step`: allocated once per shape, never freed)
    n_nodes : N = S + 1, the chain's verify tokens, root included
    clf_ids : the classifier ids (the row table's ``clf``) the graph scores with, ascending
    capture : capture a CUDA graph (on CUDA devices; False: run uncaptured, e.g. to compare)
    """

    def __init__(self, steps: Tuple[torch.Tensor, torch.Tensor], n_nodes: int, clf_ids: Sequence[int],
                 capture: bool = True):
        top = steps[0]
        rows, dev, S = top.shape[0], top.device, top.shape[1] + 1
        self.steps, self.n_nodes, self.num_steps, self.clf_ids = steps, n_nodes, S, tuple(clf_ids)
        self.static_rows = StaticRows(rows, dev)
        self.rows_in = self.static_rows.table  # [rows, F]; rows past a batch stay native
        # each classifier scores every row, each row keeps its own: reads the clf column where run() writes it
        self.classifiers = _Classifiers(list(self.clf_ids), self.rows_in[:, _CLF], dev)
        self.depth = depths(S, dev)  # [S-1]
        self.positions = positions(n_nodes, dev)  # [1, N]
        self.length = torch.zeros(rows, dtype=torch.int64, device=dev)  # [rows] kept depth (0: the root alone)
        self.keep = torch.zeros(rows, n_nodes, dtype=torch.bool, device=dev)  # [rows, N]
        self.sizes = torch.zeros(rows, dtype=torch.int64, device=dev)  # [rows] kept nodes, root included
        self._views: dict = {}  # bs -> the outputs' first bs rows (views of static buffers: built once per bs)
        self._body()  # eager first: loads the classifiers' weights and warms every kernel outside a capture
        self.graph = captured(self._body, dev) if capture else None

    def _body(self) -> None:
        beta, max_len = row_limits(self.rows_in, self.num_steps)  # [rows] each
        length = cut_lengths(*self.steps, self.depth, self.classifiers, beta, max_len)  # [rows]
        self.length.copy_(length)
        torch.le(self.positions, self.length[:, None], out=self.keep)
        torch.sum(self.keep, dim=-1, out=self.sizes)

    def run(self, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This round's cut for the stash's first ``bs`` rows.

        ``rows`` ``[bs, F]`` float32, the batch's row table (:attr:`.chain_stop.ChainStopper.rows`). Returns
        ``(length [bs] int64, keep [bs, N] bool, sizes [bs] int64)``, views of the static outputs: valid until the
        next ``run`` (read them on this stream before it, as a round does)."""
        bs = rows.shape[0]
        self.static_rows.write(rows)  # a steady batch passes its stopper's table again: already in place
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()
        views = self._views.get(bs)
        if views is None:
            views = self._views[bs] = (self.length[:bs], self.keep[:bs], self.sizes[:bs])
        return views


def cut_graph_for(steps: Tuple[torch.Tensor, torch.Tensor], key: tuple, n_nodes: int,
                  clf_ids: Sequence[int]) -> CutGraph:
    """The cut graph of stash ``key`` (``(rows, S-1, device)``) at N = ``n_nodes``, captured at server start (or on
    first use) and again, with the union, when a batch names a classifier it was not captured with, or when the
    stash is not the one it reads."""
    gkey = (key, n_nodes)
    g = CUT_GRAPHS.get(gkey)
    if g is None or not set(clf_ids) <= set(g.clf_ids) or g.steps is not steps:
        ids = sorted(set(clf_ids) | set(g.clf_ids if g is not None else ()))
        g = CUT_GRAPHS[gkey] = CutGraph(steps, n_nodes, ids)
    return g


def chain_keep(stopper: ChainStopper, rows: Optional[int], n_nodes: int,
               group=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A chain round's ``(keep [bs, N] bool, sizes [bs] int64 or None)``.

    ``rows``: the replayed draft graph's padded batch (None: the draft ran eagerly); ``group``: the verify group
    whose rank 0's cut every rank keeps (None or a group of one rank, as a one-GPU server's is: nothing to agree
    on; None also for a cut from the rows' lengths alone). A batch without a
    C2T row takes its fixed keep (no op); a C2T batch after a replay its :class:`CutGraph` where the selection is
    replayed too (:func:`.draft_select.replays_selection`: ``graph``, or ``auto`` on CUDA), else the eager cut."""
    if not stopper.reads_steps:
        return stopper.fixed_keep(n_nodes)
    if rows is not None and replays_selection(stopper.device):
        steps = stopper.steps(rows)
        key = (rows, stopper.num_steps - 1, str(stopper.device))
        length, keep, sizes = cut_graph_for(steps, key, n_nodes, stopper.clf_ids).run(stopper.rows)
        if group_size(group) <= 1:  # alone: the graph's keep and sizes as they are
            return keep, sizes
        return keep_mask(length, n_nodes, group), None  # rank 0's cut on every rank
    return keep_mask(stopper.cut(rows), n_nodes, group), None


def capture_cuts(num_steps: int, n_nodes: int) -> int:
    """Right after SGLang captured its draft graphs (server start): in chain mode with the loop recording its
    steps inside them (``TREESPEC_CHAIN_STOP_GRAPH=1``), the cut graph of every stash shape those captures wrote,
    with every registered classifier, so no round captures one. Returns how many graphs serve (none off CUDA,
    without the setting, or where the selection is not replayed)."""
    keys = sorted(k for k in _STASH if k[1] == num_steps - 1)
    if num_steps < 2 or not keys or not chain_graph_enabled() or not replays_selection(keys[0][2]):
        return 0
    ids = sorted({_clf_id(clf) for clf in registered().values()})  # ``default`` among them
    for key in keys:
        for t in _STASH[key]:  # a captured graph's writes were recorded, never run: whatever the pool held
            t.zero_()
        cut_graph_for(_STASH[key], key, n_nodes, ids)
    return len(keys)
