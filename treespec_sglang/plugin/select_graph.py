"""The fused selection as one CUDA graph per replayed draft shape (``TREESPEC_SELECT=graph``, and the default
``auto`` on CUDA; no sglang import).

SGLang replays its draft loop as a CUDA graph per batch-size bucket, and the draft-pool stash
(:mod:`.draft_select`) is a set of buffers of that bucket's shape ``(rows, P, W)``, written by every replay. A
:class:`SelectionGraph` is the fused kernel's launch (:func:`.pool_kernels.launch`) captured once per such
shape, reading the stash where the replay wrote it, so a round's selection costs a handful of copies and one
replay, whatever the batch holds:

1. ``run`` writes this round's inputs into the graph's static buffers: the ``bs`` request rows of the row
   table (:func:`.pool.policy_rows`, one op into rows ``[:bs]``, none when the batch's table is the one the
   previous round wrote: a steady batch's is cached, read-only; the padding rows stay native) and, only when the
   batch has a custom pool rule, that rule's keep (computed on the host as :func:`.pool.select_on_pool` does).
   SGLang's own ``top_scores_index`` (native rows take it verbatim) is read where the draft replay stashed it
   beside the pool; a graph without that stash copies it in each round. A steady batch's round copies nothing;
2. one replay: the pool's view of the stash (:meth:`.pool.PoolView.from_flat`) and the launch with the
   batch-independent runtime ints of :func:`.pool_kernels.graph_args`, which select the same trees as a
   launch planned for the batch;
3. the first ``bs`` rows of the outputs, as views: the next replay writes the same buffers, and every reader
   of this round's trees (``build_eagle_verify_input``, the filler unlink, the tree sizes, a ragged verify) is
   queued on the same stream within the same round, before the next round's replay; the stash's scores are
   read the same way.

A server captures its graphs at start, right after SGLang's draft graphs, one per draft shape with every
registered classifier (:func:`.draft_select.capture_selections`): a capture synchronises the device and empties
the allocator's caches, which no round should pay. The classifier table is part of the capture: a graph serves
the classifiers it was captured with, and a batch naming another one captures the shape again with the union
(:func:`graph_for`). Off CUDA nothing is captured: the same static-buffer launch runs uncaptured (the CPU
tests run it in Triton's interpreter), so one code path serves both and the tests check what a replay reads.

Example: a draft graph captured for 8 rows replays a batch of 5; the stash holds 8 rows, the selection graph
of shape (8, P, W) computes all 8 (rows 5-7 as native rows on the padded pool) and ``run`` returns rows 0-4.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from .pool import PoolView, request_row
from .pool_kernels import (classifier_table, graph_args, grown_rows, interpreted, kernels, launch, no_classifier,
                           stage_table, workspace)

__all__ = ["SelectionGraph", "StaticRows", "graph_for", "captured", "shared_workspace", "GRAPHS"]

# (stash key, N, topk) -> the graph serving it (classifier ids grow by recapture, never shrink)
GRAPHS: Dict[tuple, "SelectionGraph"] = {}
_MEMPOOL: Dict[str, object] = {}  # device -> the graphs' shared CUDA memory pool
_WORKSPACE: Dict[tuple, tuple] = {}  # (kernel module, P, device) -> the graphs' shared (work, workf) scratch


def shared_workspace(mod, rows: int, P: int, dev) -> tuple:
    """The first ``rows`` rows of the kernel's scratch (:func:`.pool_kernels.workspace`) that every selection graph
    of a pool width shares: one buffer where a graph per captured batch size held its own (at topk 8 / 6 steps
    about 20 KB a row, tens of MB over SGLang's batch-size buckets, allocated after SGLang sized its KV cache).
    Sharing is safe: the graphs replay one after another on the forward stream, and each program writes its row
    of the scratch before reading it (a round's result never depends on what it held). A graph with more rows
    grows it (:func:`.pool_kernels.grown_rows`); graphs built on an older buffer keep that one
    alive through their views (captured largest first at server start: one buffer)."""
    key = (mod, P, str(torch.device(dev)))
    work = _WORKSPACE.get(key)
    if work is None or work[0].shape[0] < rows:
        work = _WORKSPACE[key] = workspace(mod, grown_rows(None if work is None else work[0].shape[0], rows), P, dev)
    return tuple(t[:rows] for t in work)


class SelectionGraph:
    """The fused launch over one stash shape with static inputs and outputs, captured on CUDA.

    Parameters
    ----------
    stash : ``(scores [rows, P] float32, tokens [rows, P] int64, parent_list [rows, W] int64)``, the buffers
        SGLang's draft replay writes (never reallocated: :func:`.draft_select.stash_pool`)
    topk, num_draft_tokens : the server's k and N
    clf_ids : the classifier ids (the row table's ``clf``) the graph scores with, ascending
    capture : capture a CUDA graph (on CUDA devices; False: launch uncaptured, e.g. to compare)
    native : optional ``[rows, N-1]`` int64, the buffer the draft replay writes SGLang's own selection into beside
        the pool (:func:`.draft_select.stash_pool`): read in place, so ``run`` copies none in; without it ``run``
        takes SGLang's selection each round and copies it into a buffer of its own
    """

    def __init__(self, stash: Tuple[torch.Tensor, torch.Tensor, torch.Tensor], topk: int, num_draft_tokens: int,
                 clf_ids: Sequence[int] = (), capture: bool = True, native: Optional[torch.Tensor] = None):
        scores, tokens, _ = stash
        rows, P = scores.shape
        dev, N = scores.device, num_draft_tokens
        self.stash, self.k, self.clf_ids = stash, topk, tuple(clf_ids)
        self.mod = kernels(interpreted(dev))
        self.static_rows = StaticRows(rows, dev)
        self.rows_in = self.static_rows.table  # [rows, F]; rows past a batch stay native
        self.native = native  # the stash's [rows, N-1] (None: native_in is the graph's own, copied in by run)
        self.native_in = native if native is not None else torch.zeros(rows, N - 1, dtype=torch.int64, device=dev)
        self.extra_in = torch.zeros(rows, P, dtype=torch.bool, device=dev)  # [rows, P]
        self._extra_written = 0  # rows of extra_in a custom keep wrote last (zeroed before the next round)
        self.out = (torch.zeros(rows, N - 1, dtype=torch.int64, device=dev),  # top [rows, N-1]
                    torch.zeros(rows, N - 1, dtype=tokens.dtype, device=dev),  # tokens [rows, N-1]
                    torch.zeros(rows, N, dtype=torch.bool, device=dev)) + shared_workspace(self.mod, rows, P, dev)
        self.sizes = torch.zeros(rows, dtype=torch.int64, device=dev)  # [rows] kept nodes per row, root included
        self._views: dict = {}  # bs -> the outputs' first bs rows (views of static buffers: built once per bs)
        self.clf = classifier_table(self.clf_ids, dev) if self.clf_ids else no_classifier(dev)
        self.stages = stage_table(dev)
        self.args = graph_args(N, 1 + (P - topk) // (topk * topk), P, bool(self.clf_ids))
        self._body()  # eager first: compiles the kernel and builds every cached table outside a capture
        self.graph = captured(self._body, dev) if capture else None

    def _body(self) -> None:
        pool = PoolView.from_flat(*self.stash, self.k)
        launch(self.mod, pool, self.rows_in, self.stages, self.clf, self.native_in, self.extra_in, self.out, self.args)
        torch.sum(self.out[2], dim=-1, out=self.sizes)  # in the graph: no launch of its own on the host per round

    def run(self, rows: torch.Tensor, native_top: Optional[torch.Tensor] = None,
            extra_keep: Optional[torch.Tensor] = None):
        """This round's selection for the stash's first ``bs`` rows.

        Parameters
        ----------
        rows : ``[bs, F]`` float32, the batch's row table (:func:`.pool.policy_rows`)
        native_top : ``[bs, N-1]`` SGLang's ``top_scores_index`` (native rows take it verbatim); None for a graph
            that reads it from the stash (``native``), which requires it
        extra_keep : optional ``[bs, P]`` bool, the custom pool rules' keep (OR'ed in before the padding)

        Returns
        -------
        ``(top_scores_index [bs, N-1] int64, draft_tokens [bs, N-1], keep [bs, N] bool, sizes [bs] int64)``
        (``sizes``: ``keep.sum(-1)``), views of the static outputs: valid until the next ``run`` (read them on this
        stream before it, as a round does).
        """
        bs = rows.shape[0]
        self.static_rows.write(rows)
        if native_top is not None:
            self.native_in[:bs].copy_(native_top)
        elif self.native is None:
            raise ValueError("SelectionGraph.run: native_top is required when the graph has no stashed selection")
        if self._extra_written:
            self.extra_in[:self._extra_written].zero_()
            self._extra_written = 0
        if extra_keep is not None:
            self.extra_in[:bs].copy_(extra_keep)
            self._extra_written = bs
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()
        views = self._views.get(bs)
        if views is None:
            views = self._views[bs] = tuple(t[:bs] for t in self.out[:3]) + (self.sizes[:bs],)
        return views


class StaticRows:
    """A captured graph's static row table ``[rows, F]`` (columns :data:`.rows.COLUMNS`), native rows to start.

    :meth:`write` copies a batch's ``[bs, F]`` table into its first ``bs`` rows, and rows a bigger batch wrote
    before go native again (their pool or stash rows are padding). A steady batch passes its cached table again
    (the same object): already in place, no op."""

    def __init__(self, rows: int, device):
        self._native = request_row(None, device)  # [1, F]
        self.table = self._native.expand(rows, -1).clone()  # [rows, F]
        self._filled = 0  # rows the last batch wrote
        self.seen: Optional[torch.Tensor] = None  # the table the rows hold (kept: its id is not reused)

    def write(self, rows: torch.Tensor) -> None:
        """The batch's ``rows`` ``[bs, F]`` in the table's first ``bs`` rows, the rest native."""
        if rows is self.seen:
            return
        bs = rows.shape[0]
        self.table[:bs].copy_(rows)
        if bs < self._filled:
            self.table[bs:self._filled].copy_(self._native)  # [1, F] broadcast
        self._filled, self.seen = bs, rows


def captured(body: Callable[[], None], device) -> Optional["torch.cuda.CUDAGraph"]:
    """``body`` captured as a CUDA graph on a CUDA ``device`` (its static buffers written on every replay), in the
    memory pool the plugin's graphs share; None off CUDA (the caller runs ``body`` itself). Run ``body`` once
    eagerly first: a capture must not compile, load or allocate what a first call does."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    graph = torch.cuda.CUDAGraph()
    pool = _MEMPOOL.setdefault(str(dev), torch.cuda.graph_pool_handle())
    torch.cuda.synchronize(dev)
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        body()
    return graph


def graph_for(stash: Tuple[torch.Tensor, ...], key: tuple, topk: int, num_draft_tokens: int,
              clf_ids: Sequence[int], native: Optional[torch.Tensor] = None) -> SelectionGraph:
    """The selection graph of stash ``key`` (``(rows, P, W, device)``) at N = ``num_draft_tokens``, captured at
    server start (or on first use) and again when a batch names a classifier it was not captured with (with the
    union) or when the stash of SGLang's own selection (``native``) or the stash itself is not the one it reads (an
    uncaptured stash is freed when another shape is stashed, :func:`.draft_select.stash_pool`)."""
    gkey = (key, num_draft_tokens, topk)
    g = GRAPHS.get(gkey)
    if g is None or not set(clf_ids) <= set(g.clf_ids) or g.native is not native or g.stash is not stash:
        ids = sorted(set(clf_ids) | set(g.clf_ids if g is not None else ()))
        g = GRAPHS[gkey] = SelectionGraph(stash, topk, num_draft_tokens, ids, native=native)
    return g
