"""Lossless verification: greedy and exact sampling walks over trees, chain rejection sampling."""

from .chain import verify_chain
from .sampling import sample, sample_probs, target_probs
from .tree import VerifyResult, emitted_tokens, first_sibling_mask, verify_tree, walk_greedy, walk_tree

__all__ = ["verify_tree", "walk_tree", "walk_greedy", "verify_chain", "VerifyResult", "emitted_tokens", "first_sibling_mask",
           "target_probs", "sample", "sample_probs"]
