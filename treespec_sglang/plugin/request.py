"""Per-request treespec parameters from ``sampling_params.custom_params["treespec"]`` (no sglang import).

They travel with every request from ``Engine.generate``, the native HTTP API and the OpenAI API
(``extra_body={"custom_params": {...}}``) to every rank. ``validate_custom_params`` runs where
SGLang validates sampling parameters (the tokenizer manager), so a malformed value fails that
request with a clear message before it reaches the scheduler (HTTP 400 / ``ValueError``).

Inside a batch call SGLang gathers every item's outcome, so one raising item would fail the whole
call. :func:`flag_invalid_items` therefore marks each malformed batch item with its message under
``custom_params[ERROR_KEY]`` before tokenization; validation lets a marked item through and the
scheduler finishes it at once as an abort carrying that message (``meta_info["finish_reason"]``),
while the batch's other items run normally.
"""

from __future__ import annotations

from typing import Dict, Optional

from ..policies import PolicyParams, parse_spec
from ..policies.registry import pool_rule_of, registration_of
from ..policies.token_cap import split_batch_option
from ..utils.bounded import Bounded
from .classifiers import resolve_request_classifier
from .config import ServerDefaults
from .rows import _rule_row

__all__ = ["CUSTOM_KEY", "ERROR_KEY", "validate_custom_params", "request_params", "request_shares", "diagnose",
           "flag_invalid_items", "unsupported_reason"]

CUSTOM_KEY = "treespec"
ERROR_KEY = "treespec_error"  # set by flag_invalid_items on a malformed batch item


def _raw(custom_params):
    if not isinstance(custom_params, dict):
        return None
    return custom_params.get(CUSTOM_KEY)


def _parse(raw) -> PolicyParams:
    """A request's ``custom_params['treespec']`` -> its parameters; a classifier is a registered name
    (never a path: :mod:`.classifiers`). Raises ``ValueError`` naming the field and its range, or the policy
    when the plugin has no pool rule for it (registered for the engine only)."""
    p = parse_spec(resolve_request_classifier(split_batch_option(raw)[0]))
    pool_rule_of(p)  # a policy registered for the engine only: refused here, with the ones a server can draft
    try:  # the rule's row for these parameters, built (and cached) here: a rule that fails fails this request alone
        _rule_row(p)
    except ValueError:
        raise
    except Exception as e:  # an operator's rule raising anything else would otherwise fail a whole round later
        raise ValueError(f"{registration_of(p).name}: pool_rule.row failed for these parameters: "
                         f"{type(e).__name__}: {e}") from e
    return p


def diagnose(custom_params) -> Optional[str]:
    """The message a malformed ``custom_params['treespec']`` fails with (names field and range), else None."""
    raw = _raw(custom_params)
    if raw is None:
        return None
    try:
        _parse(raw)
    except ValueError as e:
        return f"custom_params['{CUSTOM_KEY}']: {e}"
    return None


def validate_custom_params(custom_params) -> None:
    """Raise ``ValueError`` (``custom_params['treespec']: ...``) if the request's value is malformed.

    A batch item already marked by :func:`flag_invalid_items` passes: the scheduler aborts it alone."""
    if isinstance(custom_params, dict) and ERROR_KEY in custom_params:
        return
    msg = diagnose(custom_params)
    if msg is not None:
        raise ValueError(msg)


def flag_invalid_items(sampling_params):
    """A batch's per-item sampling-parameter dicts with each malformed item marked (copies; others as given).

    A single dict shared by the whole batch is returned unchanged (every item is equally malformed,
    so the call fails as a whole).
    The marked item's value itself is dropped (None): only the message travels on, so a value that SGLang's
    transport cannot carry (a nested list, an integer past 64 bits, with ``SGLANG_USE_PICKLE_IPC=0``) fails
    nothing on the way to the scheduler's abort.
    Example: [{"custom_params": {"treespec": {"policy": "nope"}}}, {}] ->
    [{"custom_params": {"treespec": None, "treespec_error": "custom_params['treespec']: policy must be ..."}}, {}]
    """
    if not isinstance(sampling_params, list):
        return sampling_params
    out = []
    for sp in sampling_params:
        cp = sp.get("custom_params") if isinstance(sp, dict) else None
        msg = diagnose(cp)
        out.append(sp if msg is None else {**sp, "custom_params": {**cp, CUSTOM_KEY: None, ERROR_KEY: msg}})
    return out


_INTERNED: Dict[PolicyParams, PolicyParams] = Bounded(4096)  # parameter set -> the one object its requests share


def _interned(p: PolicyParams) -> PolicyParams:
    """The one object of ``p``'s value (frozen, so shareable): requests with the same parameters carry the same
    object, so a batch's per-composition caches (:func:`.rows.per_batch`, keyed by the objects' ids) hit when a
    request is replaced by another of the same parameters, and value-keyed caches find it without ``__eq__``.
    Bounded: past 4096 sets the table starts again (sharing lost for a while, never correctness)."""
    q = _INTERNED.get(p)
    return _INTERNED.put(p, p) if q is None else q


def request_params(sampling_params, defaults: ServerDefaults) -> Optional[PolicyParams]:
    """The request's policy: its own ``custom_params['treespec']``, else the server default, else
    None (native SGLang behaviour), one shared object per parameter set (:func:`_interned`). Raises
    ``ValueError`` (``custom_params['treespec']: ...``) for a malformed value: never a silent fallback, which
    could differ from rank to rank. Values were validated on arrival; the scheduler refuses one that still
    fails (a request built by hand) on every rank alike."""
    raw = _raw(getattr(sampling_params, "custom_params", None))
    if raw is not None:
        try:
            return _interned(_parse(raw))
        except ValueError as e:
            raise ValueError(f"custom_params['{CUSTOM_KEY}']: {e}") from None
    return _interned(_parse(defaults.spec)) if defaults.active else None


def request_shares(sampling_params) -> bool:
    """Whether the request shares the server's token cap: False only for an explicit
    ``{"token_cap": false}`` (a malformed value was refused on arrival; here it counts as sharing)."""
    try:
        return split_batch_option(_raw(getattr(sampling_params, "custom_params", None)))[1]
    except ValueError:
        return True


def unsupported_reason(p: Optional[PolicyParams], server_args) -> Optional[str]:
    """Why this server cannot draft policy ``p`` (None: it can). Never a silent native fallback.

    * ``--enable-multi-layer-eagle`` drafts in SGLang's ``MultiLayerEagleWorkerV2``, whose draft loop the
      hooks do not reach: no policy (``none`` included) can be applied there;
    * ``--speculative-use-rejection-sampling`` verifies sampled requests with a kernel that ignores the
      verify links, so a policy's tree (or cut chain) would not be what is verified;
    * ``--pp-size > 1`` (pipeline parallelism) relays the tree from the last stage to the others as SGLang's own
      ``top_scores_index`` (``EAGLEWorkerV2``'s ``draft(with_topology=True)``), not the policy's: the stages would
      verify different trees;
    * ``--speculative-eagle-topk 1`` drafts a chain: only ``chain`` (its length and C2T early stop) and
      ``none`` apply; a tree policy has no tree to choose from;
    * EAGLE-2 with a ``topk`` below the server's: SGLang's beam keeps the server's k best nodes of each level, and
      EAGLE-2's narrower beam (the k' best of each level's children of the k' kept) is not a subset of it.
      A larger ``topk`` is capped at the server's (the pool holds nothing beyond it); ``depth`` is honoured.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=1)
    >>> unsupported_reason(parse_spec({"policy": "talon"}), args).split(":")[0]
    'talon needs a draft tree'
    >>> unsupported_reason(parse_spec({"policy": "chain", "length": 2}), args) is None
    True
    """
    if p is None or server_args is None or getattr(server_args, "speculative_algorithm", None) is None:
        return None  # native, or no speculation at all (plain decoding is what every policy reduces to)
    reg = registration_of(p)
    name = reg.name
    if getattr(server_args, "enable_multi_layer_eagle", False):
        return (f"{name}: this server drafts with SGLang's multi-layer EAGLE worker (--enable-multi-layer-eagle), "
                f"which treespec policies cannot drive; send the request without custom_params['{CUSTOM_KEY}'] "
                f"or use a server without that flag")
    if getattr(server_args, "speculative_use_rejection_sampling", False):
        return (f"{name}: this server verifies sampled requests with rejection sampling "
                f"(--speculative-use-rejection-sampling), whose kernel walks every drafted token whatever tree a "
                f"policy chose; send the request without custom_params['{CUSTOM_KEY}'] or use a server without "
                f"that flag")
    pp = getattr(server_args, "pp_size", 1)
    if isinstance(pp, int) and pp > 1:
        return (f"{name}: this server runs pipeline parallelism (--pp-size {pp}), whose stages rebuild the verify "
                f"tree from SGLang's own selection, not a policy's; send the request without "
                f"custom_params['{CUSTOM_KEY}'] or use a server without pipeline parallelism")
    if getattr(server_args, "speculative_eagle_topk", None) == 1 and reg.needs_tree:
        return (f"{name} needs a draft tree: this server drafts a chain (--speculative-eagle-topk 1); use "
                f"{{'policy': 'chain'}} (length, C2T early stop with beta) or {{'policy': 'none'}}, or a server "
                f"with --speculative-eagle-topk > 1")
    k = getattr(server_args, "speculative_eagle_topk", None)
    if name == "eagle2" and isinstance(k, int) and p.topk < k:
        return (f"eagle2.topk must be >= this server's --speculative-eagle-topk {k} (a larger one is capped at {k}), "
                f"got {p.topk}: SGLang's draft beam keeps the {k} best nodes of each level, and EAGLE-2's narrower "
                f"beam cannot be taken from it; send topk >= {k}, or use a server with --speculative-eagle-topk "
                f"{p.topk}")
    return None
