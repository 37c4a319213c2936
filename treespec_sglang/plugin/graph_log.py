"""SGLang's CUDA-graph decisions, counted per runner and round kind (operator environment, off by default).

A treespec round must replay SGLang's captured graphs (draft decode, target verify, draft extend) exactly as a
native round does; an eager fallback costs a GPU round several milliseconds and is invisible in the output.
With ``TREESPEC_GRAPH_LOG=DIR`` every scheduler process counts each ``can_run_graph`` decision of those
runners, keyed ``"<runner>|<forward mode>|<replayed>|<ts or native>"`` (``ts``: the round carried a
treespec request), and rewrites ``DIR/graphs-<pid>.json`` when a key first appears and every 50th decision;
:func:`read_counts` sums the files. Tests and benchmarks read it; serving never needs it.

Example: ``{"EAGLEDraftCudaGraphRunner|DECODE|True|ts": 412, "DecodeCudaGraphRunner|TARGET_VERIFY|True|ts": 412}``
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from typing import Callable, Dict, Optional

from .settings import env

__all__ = ["ENV_GRAPH_LOG", "RUNNERS", "count_decision", "read_counts", "register_counting"]

ENV_GRAPH_LOG = "TREESPEC_GRAPH_LOG"
RUNNERS = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph",
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner.can_run_graph",
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner.can_run_graph",
)
_COUNTS: Counter = Counter()
_LABEL: Dict[str, Optional[Callable[[], bool]]] = {"treespec_round": None}


def count_decision(result, runner, forward_batch=None, *args, **kwargs):
    """``*CudaGraphRunner.can_run_graph`` AFTER: count the decision; the result is returned unchanged."""
    out = env(ENV_GRAPH_LOG)
    if not out:
        return result
    is_ts = _LABEL["treespec_round"]
    mode = getattr(getattr(forward_batch, "forward_mode", None), "name", "?")
    key = f"{type(runner).__name__}|{mode}|{bool(result)}|{'ts' if is_ts is not None and is_ts() else 'native'}"
    new = key not in _COUNTS
    _COUNTS[key] += 1
    if new or sum(_COUNTS.values()) % 50 == 0:
        with open(os.path.join(out, f"graphs-{os.getpid()}.json"), "w") as f:
            json.dump(dict(_COUNTS), f)
    return result


def read_counts(directory: str) -> Counter:
    """The decisions of every process that wrote to ``directory``, summed (lower bounds: each process's file
    lags by fewer than 50 decisions)."""
    total: Counter = Counter()
    for path in glob.glob(os.path.join(directory, "graphs-*.json")):
        with open(path) as f:
            total.update(json.load(f))
    return total


def register_counting(registry, hook_type, treespec_round: Callable[[], bool]) -> bool:
    """Register :func:`count_decision` on every runner of :data:`RUNNERS` when ``TREESPEC_GRAPH_LOG`` is set
    (``treespec_round()``: whether the round in progress carries a treespec request). Returns whether it did."""
    out = env(ENV_GRAPH_LOG)
    if not out:
        return False
    os.makedirs(out, exist_ok=True)
    _LABEL["treespec_round"] = treespec_round
    for target in RUNNERS:
        registry.register(target, count_decision, hook_type)
    return True
