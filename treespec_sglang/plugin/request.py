"""Per-request treespec parameters from ``sampling_params.custom_params["treespec"]`` (no sglang import).

They travel with every request from ``Engine.generate``, the native HTTP API and the OpenAI API
(``extra_body={"custom_params": {...}}``) to every rank. ``validate_custom_params`` runs where
SGLang validates sampling parameters (the tokenizer manager), so a malformed value fails only
that request with a clear message before it reaches the scheduler.
"""

from __future__ import annotations

from typing import Optional

from ..policies import PolicyParams, parse_spec
from .config import ServerDefaults

__all__ = ["CUSTOM_KEY", "validate_custom_params", "request_params"]

CUSTOM_KEY = "treespec"


def _raw(custom_params):
    if not isinstance(custom_params, dict):
        return None
    return custom_params.get(CUSTOM_KEY)


def validate_custom_params(custom_params) -> None:
    """Raise ``ValueError`` (``custom_params['treespec']: ...``) if the request's value is malformed."""
    raw = _raw(custom_params)
    if raw is None:
        return
    try:
        parse_spec(raw)
    except ValueError as e:
        raise ValueError(f"custom_params['{CUSTOM_KEY}']: {e}") from None


def request_params(sampling_params, defaults: ServerDefaults) -> Optional[PolicyParams]:
    """The request's policy: its own ``custom_params['treespec']``, else the server default, else
    None (native SGLang behaviour). Values were validated on arrival; a value that still fails
    (a request built by hand) falls back to the default rather than failing the batch."""
    raw = _raw(getattr(sampling_params, "custom_params", None))
    if raw is not None:
        try:
            return parse_spec(raw)
        except ValueError:
            pass
    return parse_spec(defaults.spec) if defaults.active else None
