"""The reference engine: batched tree speculative decoding on a HF Llama-family target (CPU or GPU)."""

from .engine import SpecEngine
from .kv_cache import KVCache
from .requests import GenerationResult, RequestStats

__all__ = ["SpecEngine", "GenerationResult", "RequestStats", "KVCache"]
