"""Small shared helpers (host-sync accounting)."""

from .syncs import SyncCounter, count_host_syncs

__all__ = ["SyncCounter", "count_host_syncs"]
