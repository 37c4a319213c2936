"""The command line's own pieces (dtype / pack flags, thread count); what ``treespec demo`` / ``bench`` share
with the benchmark scripts is :mod:`treespec_sglang.engine.runs`."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["add_dtype", "PACK", "DTYPE_HELP", "set_threads"]


DTYPE_HELP = ("auto (bf16 where the CPU has AMX / AVX512-BF16 or the GPU supports it, else float32), float32 "
              "(bit-exact), bfloat16; plain decoding runs in the same dtype")


PACK = {"auto": None, "on": True, "off": False}  # --pack -> SpecEngine(pack=...)


def add_dtype(p, default: str = "auto") -> None:
    p.add_argument("--dtype", default=default, help=DTYPE_HELP)
    p.add_argument("--pack", default="auto", choices=sorted(PACK),
                   help="oneDNN-prepacked linears on the CPU: auto (where the kernel passes its probe: bf16 "
                        "equal to nn.Linear on it, float32 batch-invariant), on (required: an error where not), off")


def set_threads(n: Optional[int]) -> None:
    if n:
        torch.set_num_threads(n)
