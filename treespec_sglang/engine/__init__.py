"""The reference engine: batched tree speculative decoding on a HF Llama-family target (CPU or GPU)."""

from .engine import GenerationResult, RequestStats, SpecEngine
from .kv_cache import KVCache

__all__ = ["SpecEngine", "GenerationResult", "RequestStats", "KVCache"]
