"""Draft trees and their layouts (masks, positions, FlashInfer, SGLang retrive arrays)."""

from .buffer import TreeBuffer, compact, pack_left
from .ragged import from_grid, kept_rows, to_grid
from .draft_tree import DraftTree, stack_rows
from .layouts import (FlashInferLayout, SGLangRetrive, SGLangVerifyArrays, ancestor_mask, dense_mask, flashinfer_layout,
                      pack_segments_little, positions, prefix_tree_mask, sglang_retrive, sglang_verify_arrays)

__all__ = ["DraftTree", "stack_rows", "TreeBuffer", "compact", "kept_rows", "to_grid", "from_grid", "pack_left", "ancestor_mask", "dense_mask", "positions",
           "prefix_tree_mask", "FlashInferLayout", "flashinfer_layout", "pack_segments_little",
           "SGLangRetrive", "sglang_retrive", "SGLangVerifyArrays", "sglang_verify_arrays"]
