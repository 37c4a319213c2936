"""C2T's entropy feature over the top 1000 against over the k drafted children, on the reference engine.

C2T scores a node with F(P_i, H_i, d_i) (C2T Eq. 8), H_i the entropy of its parent's distribution over the top
1000 tokens (Eq. 7): what the engine's ``C2TPolicy`` and the training data use. The SGLang plugin scores SGLang's
draft pool, which keeps each parent's k drafted children and nothing else of its distribution, so there H_i is
the entropy of those k children's probabilities (a partial sum of the top-1000 one: never larger). This runs the
engine's C2T both ways, interleaved, over a sweep of ``beta`` and prints accept length against tree size: whether
the plugin's feature ranks nodes worse (a lower curve) or only keeps more of them at the same ``beta`` (a shift
along the same curve).

Usage::

    python bench/c2t_entropy.py --prompts 16 --betas 0.3,0.4,0.5,0.6,0.7,0.8 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Iterator, List, Optional, Sequence

import torch

MODES = ("top1000", "children")


@contextlib.contextmanager
def parent_entropy(mode: str, k: int) -> Iterator[None]:
    """The engine's C2T reads its entropy feature over the top 1000 (``top1000``, as trained) or over the ``k``
    children a pool keeps (``children``, the plugin's) inside the block; the engine is as it was after."""
    import treespec_sglang.policies.c2t as c2t

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    original = c2t.entropy_topm
    if mode == "children":
        c2t.entropy_topm = lambda logprobs: original(logprobs, k)
    try:
        yield
    finally:
        c2t.entropy_topm = original


def run(engine, prompts: Sequence, betas: Sequence[float], *, budget: int = 16, topk: int = 4,
        max_new_tokens: int = 64, batch_size: int = 4) -> List[dict]:
    """One row per ``beta`` and mode (the two modes back to back at each beta): accept length ``tau`` (tokens a
    round), the mean tree size (nodes a round, root included), rounds, wall seconds, and the outputs."""
    rows = []
    for beta in betas:
        spec = {"policy": "c2t", "budget": budget, "topk": topk, "beta": beta}
        for mode in MODES:
            out, t0 = [], time.perf_counter()
            with parent_entropy(mode, topk):
                for i in range(0, len(prompts), batch_size):
                    out += engine.generate(list(prompts[i:i + batch_size]), max_new_tokens=max_new_tokens,
                                           policy=spec)
            wall = time.perf_counter() - t0
            sizes = [s for r in out for s in r.stats.tree_sizes]
            accepted = [a for r in out for a in r.stats.accepted]
            rows.append(dict(beta=beta, mode=mode, tau=1 + sum(accepted) / max(len(accepted), 1),
                             mean_tree=sum(sizes) / max(len(sizes), 1), rounds=len(sizes), wall_s=wall,
                             tokens=sum(len(r.token_ids) for r in out), out=out))
    return rows


def on_curve(points: Sequence[tuple], x: float) -> Optional[float]:
    """The piecewise-linear curve through ``points`` (``(tree size, tau)``) at tree size ``x``; None outside them.
    Example: ``on_curve([(2, 1.5), (4, 2.0)], 3)`` -> 1.75."""
    pts = sorted(points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts (half HumanEval, half MT-bench)")
    ap.add_argument("--betas", default="0.3,0.4,0.5,0.6,0.7,0.8")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4, help="k: children a parent keeps (SGLang's --speculative-eagle-topk)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    from treespec_sglang.data import humaneval, mtbench
    from treespec_sglang.engine import SpecEngine
    from treespec_sglang.engine.cost import _cpu_name
    from treespec_sglang.engine.dtypes import cpu_bf16

    engine = SpecEngine.from_pretrained("smollm2-135m", draft="demo", dtype=getattr(torch, a.dtype))
    half = a.prompts // 2
    prompts = humaneval().every(10).take(half).prompts + mtbench().every(10).take(a.prompts - half).prompts
    engine.generate(prompts[:1], max_new_tokens=2)  # warm-up
    rows = run(engine, prompts, [float(b) for b in a.betas.split(",")], budget=a.budget, topk=a.topk,
               max_new_tokens=a.max_new_tokens, batch_size=a.batch_size)
    print(f"# C2T entropy over the top 1000 vs the {a.topk} children; {len(prompts)} held-out prompts, "
          f"{a.max_new_tokens} new tokens, batch {a.batch_size}, budget {a.budget}, {a.dtype}; "
          f"{_cpu_name()} ({cpu_bf16()[1]}), torch {torch.__version__}")
    for r in rows:
        print(f"beta={r['beta']:.2f} entropy={r['mode']:<8} tau={r['tau']:.3f} mean_tree={r['mean_tree']:.2f} "
              f"rounds={r['rounds']} tok/s={r['tokens'] / r['wall_s']:.1f}")
    curve = [(r["mean_tree"], r["tau"]) for r in rows if r["mode"] == "top1000"]
    print("# children against top1000 at each beta: nodes kept (x), tau against the top1000 curve at that size")
    for top, kids in zip(rows[::2], rows[1::2]):
        ref = on_curve(curve, kids["mean_tree"])
        print(f"beta={kids['beta']:.2f} nodes x{kids['mean_tree'] / top['mean_tree']:.2f} tau {kids['tau']:.3f} vs "
              + ("outside the curve" if ref is None else f"{ref:.3f} ({kids['tau'] - ref:+.3f})"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "out"} for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
