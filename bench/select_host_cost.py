"""The host's share of a round's selection after the draft (``select_after_draft``), per selection and batch size.

On a GPU the host enqueues a round's work and then waits at SGLang's own host reads, so the plugin's Python
and dispatch time per round adds to every round wherever the device is not the bottleneck. This measures that
host part on any machine: for ``triton`` (the fused launch after an eager draft) the kernel launch is stubbed
out; for ``graph`` (the launch captured per replayed draft shape, :mod:`treespec_sglang.plugin.select_graph`)
the captured body is stubbed out, leaving what the host does around one ``graph.replay()``; ``torch`` runs the
torch selection whole (on the CPU its time includes the compute: read its ATen ops as its host cost on a GPU,
about 5-10 us each). ``--no-batch-cache`` also measures each without the per-composition cache of row tables
and batch plans (:func:`treespec_sglang.plugin.rows.per_batch`), side by side in the same run. ``--unlink`` adds
what the verify-input hook does next, taking the padding out of SGLang's ``[bs, N]`` verify chains
(:func:`treespec_sglang.plugin.draft_select.unlink`: the fused kernel's launch, stubbed like the selection's, or
the torch unlink and its two copies).

    python bench/select_host_cost.py                      # bs 1 / 16 / 64 / 256, topk 8, steps 6, N 48
    python bench/select_host_cost.py --no-batch-cache --json out.json

Per row: microseconds of host time per round (median of ``--repeats`` steady-state calls, the same requests
every round), ATen ops dispatched (CUDA launches, bar views), host reads, host->device list copies.
``--launch --device cuda`` launches and replays for real and synchronises each call (host and device time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from treespec_sglang.plugin import draft_select, pool, pool_kernels, select_graph, unlink_kernel  # noqa: E402
from treespec_sglang.plugin import rows as rows_module  # noqa: E402
from treespec_sglang.plugin.round import DraftStep  # noqa: E402
from treespec_sglang.policies import parse_spec  # noqa: E402
from treespec_sglang.utils.syncs import count_ops  # noqa: E402

SPECS = [None, {"policy": "eagle2", "budget": 32}, {"policy": "talon", "budget": 32, "mu": 0.05},
         {"policy": "salf", "budget": 32, "th": 0.1}, {"policy": "c2t", "budget": 32, "beta": 0.4},
         {"policy": "chain", "length": 5}]


def sglang_pool(bs, k, S, device, seed=0):
    """A draft pool of SGLang's shape (the stash's tensors): scores [bs, P], tokens [bs, P], parent_list [bs, W]."""
    g = torch.Generator().manual_seed(seed)
    P = k + (S - 1) * k * k
    scores = torch.rand(bs, P, generator=g).sort(-1, descending=True).values
    return (scores.to(device), torch.randint(0, 32000, (bs, P), generator=g).to(device),
            torch.tensor([pool.first_child_parents(k, S)] * bs, device=device))


def pool_lists(scores, tokens, parents, k):
    """:func:`sglang_pool`'s tensors as ``organize_draft_results`` receives them (``score_list``, ``token_list``,
    ``parents_list``): the first draft step's ``[bs, 1, k]`` / ``[bs, k]`` / ``[bs, k + 1]``, then the rest."""
    bs = scores.shape[0]
    return ([scores[:, :k].view(bs, 1, k), scores[:, k:].reshape(bs, -1, k)], [tokens[:, :k], tokens[:, k:]],
            [parents[:, :k + 1], parents[:, k + 1:], None])


def measure(mode, bs, a, cached):
    """``(us per round, ops, reads, copies)`` of ``select_after_draft`` in ``mode`` for ``bs`` requests."""
    k, S, N = a.topk, a.steps, a.N
    params = [None if s is None else parse_spec(s) for s in (SPECS[i % len(SPECS)] for i in range(bs))]
    scores, tokens, parents = sglang_pool(bs, k, S, a.device)
    native = pool.select_on_pool(pool.PoolView.from_flat(scores, tokens, parents, k), N, [None] * bs)
    # SGLang's own selection stashed beside the pool, as organize_draft_results' hook does (a graph reads it there)
    draft_select.stash_pool(*pool_lists(scores, tokens, parents, k), native[1])
    rows = bs if mode == "graph" else None  # graph: the draft replayed (a stash of its shape); else eager
    env = {draft_select.ENV_SELECT: "triton" if mode == "triton" else mode}
    patches = [mock.patch.dict(os.environ, env)]
    if a.launch:
        pass  # the real launch / replay, synchronised per call: host and device time together
    elif mode == "triton":
        patches.append(mock.patch.object(pool_kernels, "launch", lambda *x, **y: None))
    if mode == "graph" and not a.launch:
        patches.append(mock.patch.object(select_graph.SelectionGraph, "_body", lambda self: None))
    if mode in ("triton", "graph") and not a.launch:
        patches.append(mock.patch.object(unlink_kernel, "launch_unlink", lambda *x, **y: None))
    chains = [torch.full((bs, N), -1, dtype=torch.long, device=a.device) for _ in range(2)]  # [bs, N] each
    if not cached:
        uncached = lambda what, params, extra, build: build()  # noqa: E731
        patches += [mock.patch.object(pool, "per_batch", uncached),
                    mock.patch.object(rows_module, "per_batch", uncached)]
    for p in patches:
        p.start()
    try:
        def once():
            step = DraftStep(params, k)
            draft_select.select_after_draft(step, rows, native[1], native[2], N, S)
            if a.unlink:
                draft_select.unlink(*chains, step.keep)

        once()  # builds the rows, tables, the graph
        with count_ops() as c:
            once()
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            once()
            if a.launch and torch.device(a.device).type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e6)
    finally:
        for p in reversed(patches):
            p.stop()
    return statistics.median(times), c.ops, c.reads, c.copies


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bs", default="1,16,64,256")
    ap.add_argument("--select", default="torch,triton,graph")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--N", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--launch", action="store_true", help="launch the kernel / replay the graph for real (CUDA: "
                    "each call synchronised, so host and device time; on the CPU the interpreter's time)")
    ap.add_argument("--no-batch-cache", action="store_true", help="also measure without the per-composition cache")
    ap.add_argument("--unlink", action="store_true", help="also the filler unlink that follows in the same hook")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    machine = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, device {a.device}"
    what = "select_after_draft + unlink" if a.unlink else "select_after_draft"
    print(f"# {what} host cost, topk {a.topk}, steps {a.steps}, N {a.N}; {machine}")
    out = []
    for mode in a.select.split(","):
        for bs in (int(b) for b in a.bs.split(",")):
            for cached in ([True, False] if a.no_batch_cache else [True]):
                us, ops, reads, copies = measure(mode, bs, a, cached)
                row = dict(select=mode, bs=bs, batch_cache=cached, launch=a.launch, unlink=a.unlink, us=round(us, 1),
                           ops=ops, reads=reads, copies=copies)
                out.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(machine=machine, args=vars(a), rows=out), f, indent=1)


if __name__ == "__main__":
    main()
