"""Offline prompt sets (HumanEval, MT-bench) read from data files that PyPI wheels ship."""

from .prompts import PromptSet, humaneval, load_prompt_set, mtbench

__all__ = ["PromptSet", "humaneval", "mtbench", "load_prompt_set"]
