"""Models: a Llama-family target with explicit KV/mask control, the EAGLE draft head, the demo target."""

from .demo import demo_target
from .draft_head import EagleDraftHead
from .llama import LlamaConfig, LlamaModel

__all__ = ["LlamaConfig", "LlamaModel", "EagleDraftHead", "demo_target"]
