"""The command line's own pieces (dtype / pack flags, thread count); what ``treespec demo`` / ``bench`` share
with the benchmark scripts is :mod:`treespec_sglang.engine.runs`."""

from __future__ import annotations

import argparse
from typing import Optional

import torch

__all__ = ["add_dtype", "PACK", "DTYPE_HELP", "set_threads", "int_at_least"]


DTYPE_HELP = ("auto (bf16 where the CPU has AMX / AVX512-BF16 or the GPU supports it, else float32), float32 "
              "(exact), bfloat16; plain decoding runs in the same dtype")


def int_at_least(lo: int):
    """An argparse ``type``: an integer >= ``lo``. argparse names the flag in its error and exits with code 2
    (``argument --every: must be an integer >= 1, got 0``), where a negative count sliced prompts away silently and
    a zero divided by zero."""
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {raw!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {value}")
        return value

    parse.__name__ = f"integer >= {lo}"
    return parse


PACK = {"auto": None, "on": True, "off": False}  # --pack -> SpecEngine(pack=...)


def add_dtype(p, default: str = "auto") -> None:
    p.add_argument("--dtype", default=default, help=DTYPE_HELP)
    p.add_argument("--pack", default="auto", choices=sorted(PACK),
                   help="oneDNN-prepacked linears on the CPU: auto (where the kernel passes its probe: bf16 "
                        "equal to nn.Linear on it, float32 batch-invariant), on (required: an error where not), off")


def set_threads(n: Optional[int]) -> None:
    if n:
        torch.set_num_threads(n)
