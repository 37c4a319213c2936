"""Small shared helpers (host-sync accounting, CUDA-graph capture, bounded memo tables)."""

from .syncs import SyncCounter, count_host_syncs

__all__ = ["SyncCounter", "count_host_syncs"]
