"""Tree-attention backends: a small ABC and a registry with lazy imports.

``plan(tree, prefix_lens, ...)`` once per verify step, ``run(q, k, v)`` once per layer, on
ragged tensors laid out like FlashInfer: ``q [sum qo_i, heads, head_dim]`` (request i's tree
nodes), ``k, v [sum kv_i, kv_heads, head_dim]`` (request i's prefix, then its tree nodes).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Dict, Type

import torch

from ..tree import DraftTree

__all__ = ["TreeAttentionBackend", "register_backend", "get_backend", "BACKENDS"]

BACKENDS: Dict[str, Type["TreeAttentionBackend"]] = {}
_LAZY = {"torch": ".reference", "flashinfer": ".flashinfer_backend"}


def register_backend(cls):
    BACKENDS[cls.name] = cls
    return cls


def get_backend(name: str, **kwargs) -> "TreeAttentionBackend":
    """Instantiate a backend by name (``torch`` or ``flashinfer``), importing it on first use."""
    if name not in _LAZY:
        raise ValueError(f"attention backend must be one of {sorted(_LAZY)}, got {name!r}")
    if name not in BACKENDS:
        importlib.import_module(_LAZY[name], __package__)
    return BACKENDS[name](**kwargs)


class TreeAttentionBackend(ABC):
    name: str

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    @abstractmethod
    def plan(self, tree: DraftTree, prefix_lens: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int) -> None:
        """Build the step's layout (host side, once per step)."""

    @abstractmethod
    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend: ragged ``q``/``k``/``v`` -> ``[sum qo_i, heads, head_dim]``."""
