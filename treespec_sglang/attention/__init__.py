"""Tree attention: the plain-torch oracle and the FlashInfer backend (imported lazily)."""

from .base import BACKENDS, TreeAttentionBackend, get_backend, register_backend
from .reference import TorchTreeAttention, tree_attention

__all__ = ["tree_attention", "TreeAttentionBackend", "TorchTreeAttention", "get_backend", "register_backend",
           "BACKENDS"]
