"""What the plugin's per-request selection adds to a speculative round, per policy and batch size.

For each batch size and policy set, on an SGLang-shaped draft pool (``select_top_k_tokens``' score /
token / parent lists for topk k and S steps), the steady-state call of ``select_from_pool`` (second
call, the same requests) is counted with a TorchDispatchMode: ATen ops, host reads (``.item()``,
``bool(t)``, ``.tolist()``, data-dependent shapes) and host->device list copies; then timed (median
of ``--repeats`` calls, microseconds of CPU time per round). On CUDA, ``--graph`` also captures the
selection in a torch CUDA graph and compares outputs and milliseconds per round, eager vs replay, and counts
the kernels a round launches (``launches``, torch.profiler). ``--select torch,triton`` measures the torch
selection and the fused Triton kernel (:mod:`treespec_sglang.plugin.pool_kernels`) side by side in one run, and
checks that they select the same trees (on the CPU the kernel runs in Triton's interpreter: its times mean nothing
there, its op counts do).

    python bench/plugin_overhead.py                      # bs 1 / 16 / 64, topk 8, steps 6, N 48
    python bench/plugin_overhead.py --device cuda --graph --select torch,triton

Targets at bs 16, topk 8, steps 6, N 48: 0 host reads, 0 list copies,
<= 300 ops for one policy, <= 900 for the four-policy mix, the same counts at bs 64.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import time

import torch

from treespec_sglang.plugin.pool import PoolView, select_from_pool
from treespec_sglang.policies import parse_spec
from treespec_sglang.utils.syncs import count_ops

try:
    from treespec_sglang.plugin.pool import policy_rows
except ImportError:  # an older checkout, measured for the before / after table
    policy_rows = None

SETS = {
    "eagle2": [{"policy": "eagle2", "budget": 48}],
    "talon": [{"policy": "talon", "budget": 48}],
    "salf": [{"policy": "salf", "budget": 48}],
    "c2t": [{"policy": "c2t", "budget": 48}],
    "chain": [{"policy": "chain", "length": 6}],
    "mix4": [{"policy": "talon", "budget": 48}, {"policy": "salf", "budget": 48},
             {"policy": "c2t", "budget": 48}, {"policy": "eagle2", "budget": 48}],
}


def sglang_shaped_pool(bs: int, k: int, steps: int, vocab: int, device, seed: int = 0, sharpness: float = 3.0):
    """SGLang's draft loop lists (``select_top_k_tokens``) for random draft distributions.

    Returns ``(score_list, token_list, parents_list)``: score_list[0] ``[bs, 1, k]``, score_list[i]
    ``[bs, k, k]``; token_list[0] ``[bs, k]``, token_list[i] ``[bs, k*k]``; parents_list[0]
    ``[bs, k + 1]`` = arange(-1, k), parents_list[i] ``[bs, k]`` flat indices of step i's frontier.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)

    def probs(*shape):
        return torch.softmax(torch.randn(*shape, vocab, generator=g) * sharpness, -1).to(device)

    p, tok = probs(bs).topk(k, dim=-1)
    score_list, token_list = [p[:, None, :]], [tok]
    parents_list = [torch.arange(-1, k, device=device).expand(bs, k + 1)]
    scores = p
    for i in range(1, steps):
        tp, ti = probs(bs, k).topk(k, dim=-1)  # [bs, k, k]
        expand = scores[:, :, None] * tp
        scores, idx = expand.flatten(1).topk(k, dim=-1)
        score_list.append(expand)
        token_list.append(ti.flatten(1))
        parents_list.append(idx + (k * k * (i - 1) + k))
    return score_list, token_list, parents_list


def batch_params(name: str, bs: int):
    specs = SETS[name]
    return [parse_spec(specs[i % len(specs)]) for i in range(bs)]


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def selection_call(select: str, lists, params, a):
    """A round's selection as a no-argument call: ``torch`` (``select_from_pool``) or ``triton`` (the fused kernel
    on the same pool lists)."""
    takes_rows = "rows" in inspect.signature(select_from_pool).parameters
    kw = {}
    if takes_rows and policy_rows is not None:
        kw["rows"] = policy_rows(params, a.device)  # what the plugin keeps per request
    if select == "torch":
        return lambda: select_from_pool(*lists, a.N, a.topk, params, **kw)
    from treespec_sglang.plugin.pool_kernels import select_on_pool_fused
    return lambda: select_on_pool_fused(PoolView(*lists, a.topk), a.N, params, None, kw.get("rows"))


def cuda_launches(call) -> int:
    """Kernels and copies one call puts on the CUDA device (torch.profiler's device events)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def measure(name: str, bs: int, a, select: str = "torch") -> dict:
    lists = sglang_shaped_pool(bs, a.topk, a.steps, a.vocab, a.device, seed=bs)
    params = batch_params(name, bs)
    call = selection_call(select, lists, params, a)
    out = call()  # the first call builds the cached rows / tables
    if select != "torch":  # the same trees as the torch selection
        ref = selection_call("torch", lists, params, a)()
        same = all(torch.equal(x, y) for x, y in zip(ref[1:], out[1:]))
    with count_ops() as c:
        call()
    times = []
    for _ in range(a.repeats):
        _sync(a.device)
        t0 = time.perf_counter()
        call()
        _sync(a.device)
        times.append((time.perf_counter() - t0) * 1e6)
    row = dict(set=name, bs=bs, select=select, ops=c.ops, host_reads=c.reads, list_copies=c.copies,
               us_per_round=round(statistics.median(times), 1))
    if select != "torch":
        row["same_trees"] = same
    if torch.device(a.device).type == "cuda":
        row["launches"] = cuda_launches(call)
        if a.graph:
            row.update(graph_vs_eager(call))
    return row


def graph_vs_eager(call) -> dict:
    """Capture ``call`` in a CUDA graph; outputs must equal the eager ones; ms per round each way."""
    from treespec_sglang.utils.cuda_graphs import capture  # only with --graph (an older tree may lack it)

    ref = call()
    graph, out = capture(call, warmup=3)
    graph.replay()
    torch.cuda.synchronize()
    equal = all(torch.equal(x, y) for x, y in zip(ref, out))

    def per_round(fn, n=50):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / n

    return dict(graph_equal=equal, eager_ms=round(per_round(call), 3), graph_ms=round(per_round(graph.replay), 4))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", default="1,16,64")
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--N", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--graph", action="store_true", help="CUDA only: also capture and replay in a CUDA graph")
    ap.add_argument("--select", default="torch", help="comma list of torch, triton (the fused kernel)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    dev = torch.cuda.get_device_name() if torch.device(a.device).type == "cuda" else platform.processor() or "cpu"
    print(f"# select_from_pool, topk {a.topk}, steps {a.steps}, N {a.N}, device {a.device} ({dev}), torch "
          f"{torch.__version__}, 1 thread")
    rows = []
    for name in a.sets.split(","):
        for bs in (int(x) for x in a.bs.split(",")):
            for select in a.select.split(","):
                r = measure(name, bs, a, select)
                rows.append(r)
                print(" ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
