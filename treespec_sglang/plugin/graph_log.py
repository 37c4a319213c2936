"""SGLang's CUDA-graph decisions, counted per runner and round kind (operator environment, off by default).

A treespec round must replay SGLang's captured graphs (draft decode, target verify, draft extend) exactly as a
native round does; an eager fallback costs a GPU round several milliseconds and is invisible in the output.
With ``TREESPEC_GRAPH_LOG=DIR`` every scheduler process counts how each of those forwards ran, keyed
``"<runner>|<forward mode>|<replayed>|<ts or native>"`` (``ts``: the round carried a treespec request), and
rewrites ``DIR/graphs-<pid>.json`` when a key first appears and every 50th count; :func:`read_counts` sums the
files. Tests and benchmarks read it; serving never needs it.

The draft is counted where it runs: a replay of SGLang's draft graph (``EAGLEDraftCudaGraphRunner.execute``) or
its eager loop (``EagleDraftWorker.draft_forward``), since the decision ``can_run_graph`` returns is not the last
word there (the plugin sends a C2T chain round to the eager loop after it, SGLang a DSA target's). The target's
verify and the draft extend count their runners' ``can_run_graph`` decisions; a ragged verify is asked twice
(when its inputs are prepared, before the plugin plans it: True; in its forward: False) and counted both times.

Example: ``{"EAGLEDraftCudaGraphRunner|DECODE|True|ts": 412, "DecodeCudaGraphRunner|TARGET_VERIFY|True|ts": 412}``
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from typing import Callable, Dict, Optional

from .settings import env

__all__ = ["ENV_GRAPH_LOG", "RUNNERS", "count_decision", "count_draft_replay", "count_draft_eager", "read_counts",
           "register_counting"]

ENV_GRAPH_LOG = "TREESPEC_GRAPH_LOG"
_DRAFT_RUNNER = "EAGLEDraftCudaGraphRunner"
_COUNTS: Counter = Counter()
_LABEL: Dict[str, Optional[Callable[[], bool]]] = {"treespec_round": None, "in_round": None}


def _count(runner: str, forward_batch, replayed: bool) -> None:
    out = env(ENV_GRAPH_LOG)
    if not out:
        return
    is_ts = _LABEL["treespec_round"]
    mode = getattr(getattr(forward_batch, "forward_mode", None), "name", "?")
    key = f"{runner}|{mode}|{replayed}|{'ts' if is_ts is not None and is_ts() else 'native'}"
    new = key not in _COUNTS
    _COUNTS[key] += 1
    if new or sum(_COUNTS.values()) % 50 == 0:
        with open(os.path.join(out, f"graphs-{os.getpid()}.json"), "w") as f:
            json.dump(dict(_COUNTS), f)


def count_decision(result, runner, forward_batch=None, *args, **kwargs):
    """``*CudaGraphRunner.can_run_graph`` AFTER: count the decision; the result is returned unchanged."""
    _count(type(runner).__name__, forward_batch, bool(result))
    return result


def count_draft_replay(result, runner, forward_batch=None, *args, **kwargs):
    """``EAGLEDraftCudaGraphRunner.execute`` AFTER: a replayed draft."""
    _count(type(runner).__name__, forward_batch, True)
    return result


def count_draft_eager(result, worker, forward_batch=None, *args, **kwargs):
    """``EagleDraftWorker.draft_forward`` AFTER: an eager draft loop of a round, counted under the draft graph's
    runner (SGLang's draft graph capture runs the loop too, outside any round: not counted)."""
    in_round = _LABEL["in_round"]
    if in_round is None or in_round():
        _count(_DRAFT_RUNNER, forward_batch, False)
    return result


# target -> the AFTER body that counts there
RUNNERS = {
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph": count_decision,
    f"sglang.srt.speculative.eagle_draft_cuda_graph_runner.{_DRAFT_RUNNER}.execute": count_draft_replay,
    "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.draft_forward": count_draft_eager,
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner.can_run_graph":
        count_decision,
}


def read_counts(directory: str) -> Counter:
    """The counts of every process that wrote to ``directory``, summed (lower bounds: each process's file lags by
    fewer than 50 counts)."""
    total: Counter = Counter()
    for path in glob.glob(os.path.join(directory, "graphs-*.json")):
        with open(path) as f:
            total.update(json.load(f))
    return total


def register_counting(registry, hook_type, treespec_round: Callable[[], bool],
                      in_round: Optional[Callable[[], bool]] = None) -> bool:
    """Register each body of :data:`RUNNERS` on its target when ``TREESPEC_GRAPH_LOG`` is set
    (``treespec_round()``: whether the round in progress carries a treespec request; ``in_round()``: whether a
    round is in progress at all). Returns whether it did."""
    out = env(ENV_GRAPH_LOG)
    if not out:
        return False
    os.makedirs(out, exist_ok=True)
    _LABEL["treespec_round"], _LABEL["in_round"] = treespec_round, in_round
    for target, body in RUNNERS.items():
        registry.register(target, body, hook_type)
    return True
