"""Old public names kept as deprecated aliases: one warning that names the new one."""

from __future__ import annotations

import warnings

__all__ = ["warn_renamed", "renamed_arg", "UNSET"]


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Emit a ``DeprecationWarning``: ``old`` is deprecated, use ``new`` (it means the same).

    ``stacklevel`` 3 points at the caller of the function that accepted ``old``."""
    warnings.warn(f"{old} is deprecated: use {new} (same meaning)", DeprecationWarning, stacklevel=stacklevel)


UNSET = object()  # the default of a deprecated keyword: "not given" (None may be a real value)


def renamed_arg(new_value, old_value, old: str, new: str, default=None, stacklevel: int = 4):
    """The value of an argument that has a deprecated old name: ``new_value``, or ``old_value`` (with a
    ``DeprecationWarning``) when the caller gave the old name. Giving both raises ``ValueError``.

    ``stacklevel`` 4 points at the caller of the function that took both keywords."""
    if old_value is UNSET:
        return new_value
    warn_renamed(old, new, stacklevel)
    if new_value is not default:
        raise ValueError(f"{old} is the deprecated name of {new}: give {new} only")
    return old_value
