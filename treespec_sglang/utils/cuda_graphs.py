"""Capture a function in a torch CUDA graph, the way servers do (warm-up on a side stream first)."""

from __future__ import annotations

from typing import Any, Callable, Tuple

import torch

__all__ = ["capture"]


def capture(fn: Callable[[], Any], warmup: int = 1) -> Tuple["torch.cuda.CUDAGraph", Any]:
    """Run ``fn`` ``warmup`` times on a side stream (lazy allocations, caches), then capture one call.

    Returns ``(graph, out)``: ``graph.replay()`` re-runs the captured kernels on the same buffers, and
    ``out`` is what the captured call returned (those buffers, rewritten by every replay). CUDA only.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
