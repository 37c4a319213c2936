"""Small shared helpers (host-sync accounting, deprecated-name warnings)."""

from .deprecation import warn_renamed
from .syncs import SyncCounter, count_host_syncs

__all__ = ["SyncCounter", "count_host_syncs", "warn_renamed"]
