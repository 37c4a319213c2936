"""A verify forward's matmuls on the CPU against their row count: where fewer tokens cost more.

A ragged verify (``plugin/ragged.py``) runs ``T = sum_b n_b`` tokens instead of ``bs * N``; on the CPU that is only
a gain where the target's matmuls cost less for fewer rows. This times ``F.linear`` of ``[rows, in]`` by each weight
of the demo target's shape (the LM head, the MLP's and the attention's projections; float32, the test bed's one
thread) for rows 1 to ``--max-rows``, and prints ms per call with the machine named. On the 2-core Xeon (AVX512-BF16,
torch 2.14.1, MKL 2024.2) below 16 rows the time grows by one step every 3 rows, then drops at 16: the MLP's
projections 0.12 ms at 1-3 rows, 0.47 at 10-12, 0.58 at 13-15 and 0.40-0.43 at 16; the LM head 4.8 ms at one row,
14.5 at 8, 22.6-23.8 at 13-15 and 17.0 at 16 (``bench/measured/cpu-avx512/cpu_gemm_rows.json``).

    python bench/cpu_gemm_rows.py --json bench/measured/cpu-avx512/cpu_gemm_rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"lm_head": (49152, 576), "mlp_up": (1536, 576), "mlp_down": (576, 1536), "qkv": (960, 576)}  # [out, in]


def time_rows(out_f: int, in_f: int, rows: int, calls: int) -> float:
    """Median ms of ``calls`` calls of ``F.linear`` of a ``[rows, in_f]`` input by an ``[out_f, in_f]`` weight."""
    w, x = torch.randn(out_f, in_f), torch.randn(rows, in_f)
    for _ in range(2):
        F.linear(x, w)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        F.linear(x, w)
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-rows", type=int, default=32)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CPU test bed's engine runs 1)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from treespec_sglang.engine.cost import _cpu_name
    from treespec_sglang.engine.dtypes import cpu_bf16

    torch.set_num_threads(a.threads)
    machine = (f"{_cpu_name()} ({cpu_bf16()[1]}), {os.cpu_count()} cores, {a.threads} thread(s), "
               f"torch {torch.__version__}")
    print(f"# F.linear ms per call by row count, float32; {machine}")
    out = {"machine": machine, "ms": {}}
    for name in a.shapes.split(","):
        out_f, in_f = SHAPES[name]
        calls = 5 if out_f * in_f > 10_000_000 else 100
        ms = [round(time_rows(out_f, in_f, r, calls), 3) for r in range(1, a.max_rows + 1)]
        out["ms"][name] = ms
        print(f"{name} [{out_f}, {in_f}]: " + " ".join(f"{r}:{m}" for r, m in enumerate(ms, 1)), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
