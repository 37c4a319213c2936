"""Prometheus series of the plugin, beside SGLang's own on ``/metrics`` (no sglang import).

With ``--enable-metrics`` SGLang runs ``prometheus_client`` in multiprocess mode (every process writes
to ``PROMETHEUS_MULTIPROC_DIR``; the HTTP server aggregates). The plugin's hooks turn these series on
in the processes where SGLang creates its own collectors, with SGLang's labels (``model_name``,
``tp_rank``, ``pp_rank``, ``dp_rank`` where set, ...) plus ``policy``:

| series | type | meaning |
|---|---|---|
| ``treespec:requests_total`` | counter | requests that drafted at least one round with a treespec policy |
| ``treespec:rounds_total`` | counter | verify rounds committed for them (one per accept length) |
| ``treespec:accepted_draft_tokens_total`` | counter | accepted draft tokens (bonus excluded) |
| ``treespec:verified_tokens_total`` | counter | tokens the target's verify forward ran for them |
| ``treespec:tree_size`` | histogram | verified nodes per round, root included |
| ``treespec:accept_length`` | histogram | accepted draft tokens per round |
| ``treespec:verify_forwards_total`` | counter | treespec rounds' verify forwards by ``path``: ``ragged`` / ``padded`` |
| ``treespec:refused_requests_total`` | counter | requests refused for a bad ``custom_params["treespec"]``, by ``field`` |

``treespec:verify_forwards_total`` has ``path`` instead of ``policy`` (a forward serves the whole batch):
``ragged`` when any request ran fewer than N tokens, ``padded`` when all ran N (``TREESPEC_RAGGED_VERIFY``).
The other counters are the sums of the responses' ``meta_info`` lists (``treespec_accept_lengths``,
``treespec_verify_tokens``, ``treespec_tree_sizes``): both are recorded by the same hooks, at the same
moment, except for a round drafted and verified for a request that had already stopped (SGLang's overlap
scheduler, a stop on EOS): the series count that work, the response leaves the round out
(:meth:`.stats.RequestStats.close`). Only SGLang's stats-logging rank of each group (``attn_tp_rank`` 0) has a
collector, so a round is counted once per group, as SGLang counts its ``sglang:spec_accept_length``.
"""

from __future__ import annotations

import bisect
import collections
import logging
import re
from typing import Dict, Mapping, Optional, Sequence

logger = logging.getLogger("treespec_sglang.plugin")

__all__ = ["SchedulerSeries", "observe_all", "bulk_observable", "refused_field", "enable_scheduler",
           "enable_tokenizer", "scheduler_series", "count_refused", "TREE_SIZE_BUCKETS", "ACCEPT_LENGTH_BUCKETS"]

TREE_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ACCEPT_LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)

_scheduler: Optional["SchedulerSeries"] = None
_refused = None  # (Counter, labels) in a tokenizer process with metrics on


def _labels(labels: Mapping) -> Dict[str, str]:
    return {str(k): "" if v is None else str(v) for k, v in dict(labels or {}).items()}


def bulk_observable(child) -> bool:
    """Whether :func:`observe_all` can update the histogram ``child`` in bulk: the ``prometheus_client``
    histogram layout it relies on (``_upper_bounds``, one ``_buckets`` value per bound, ``_sum``; 0.x to 0.26)."""
    bounds, buckets = getattr(child, "_upper_bounds", None), getattr(child, "_buckets", None)
    return (isinstance(bounds, (list, tuple)) and isinstance(buckets, list) and len(bounds) == len(buckets) > 0
            and hasattr(child, "_sum") and all(hasattr(b, "inc") for b in buckets + [child._sum]))


def observe_all(child, values: Sequence[int], bulk: bool = True) -> None:
    """Observe every value of ``values`` on the histogram ``child``, to the same bucket counts and sum as
    ``observe`` called once per value: the values counted per bucket first (``observe`` puts a value in the first
    bucket whose bound is >= it), then one increment per bucket hit and one of the sum. In multiprocess mode
    each increment is a locked write to a mmapped file, so a round of 64 requests costs a handful of writes
    instead of 128. ``bulk=False`` (a layout :func:`bulk_observable` does not know): ``observe`` per value."""
    if not bulk:
        for v in values:
            child.observe(v)
        return
    if not values:
        return
    bounds, buckets, hits = child._upper_bounds, child._buckets, {}
    # counted in C first when there are many (few distinct values: tree sizes, accept lengths), else one by one
    for v, n in (collections.Counter(values).items() if len(values) > 16 else ((v, 1) for v in values)):
        i = bisect.bisect_left(bounds, v)
        hits[i] = hits.get(i, 0) + n
    child._sum.inc(sum(values))
    for i, n in hits.items():
        buckets[i].inc(n)


class SchedulerSeries:
    """The per-round series of one scheduler process, labelled with SGLang's labels + ``policy``."""

    def __init__(self, labels: Mapping):
        from prometheus_client import Counter, Histogram

        self.labels = _labels(labels)
        names = [*self.labels, "policy"]
        self.requests = Counter("treespec:requests", "Requests drafted with a treespec policy", names)
        self.rounds = Counter("treespec:rounds", "Verify rounds committed for treespec requests", names)
        self.accepted = Counter("treespec:accepted_draft_tokens", "Accepted draft tokens (bonus excluded)", names)
        self.verified = Counter("treespec:verified_tokens", "Tokens the target's verify forward ran", names)
        self.tree_size = Histogram("treespec:tree_size", "Verified nodes per round (root included)", names,
                                   buckets=TREE_SIZE_BUCKETS)
        self.accept_length = Histogram("treespec:accept_length", "Accepted draft tokens per round", names,
                                       buckets=ACCEPT_LENGTH_BUCKETS)
        self.verify_forwards = Counter("treespec:verify_forwards", "Target verify forwards of treespec rounds, by "
                                       "path (ragged: kept nodes only; padded: N per request)", [*self.labels, "path"])
        self._children: Dict[tuple, object] = {}  # (series, label value) -> its labelled child, looked up once
        self.bulk: Optional[bool] = None  # observe_all's bulk path, decided on the first histogram child

    def _child(self, series, value: str, label: str = "policy"):
        """``series`` labelled ``label=value`` (beside SGLang's labels), created on its first value (as
        ``labels()`` would) and kept: ``labels()`` validates and locks on every call, and the rounds' hooks
        observe every round."""
        child = self._children.get((series, value))
        if child is None:
            child = self._children[(series, value)] = series.labels(**self.labels, **{label: value})
        return child

    def verify_forward(self, ragged: bool) -> None:
        """One target verify forward of a treespec round, ragged or padded."""
        self._child(self.verify_forwards, "ragged" if ragged else "padded", "path").inc()

    def new_request(self, policy: str) -> None:
        self._child(self.requests, policy).inc()

    def drafted(self, policy: str, tree_sizes: Sequence[int]) -> None:
        """One round's tree sizes of a policy's requests (one value per request)."""
        self._observe(self.tree_size, policy, tree_sizes)

    def verified_tokens(self, policy: str, counts: Sequence[int]) -> None:
        self._child(self.verified, policy).inc(sum(counts))

    def accepted_round(self, policy: str, accept_lengths: Sequence[int]) -> None:
        """One round's accept lengths of a policy's requests: a round each, their sum, each length observed."""
        self._child(self.rounds, policy).inc(len(accept_lengths))
        self._child(self.accepted, policy).inc(sum(accept_lengths))
        self._observe(self.accept_length, policy, accept_lengths)

    def _observe(self, histogram, policy: str, values: Sequence[int]) -> None:
        child = self._child(histogram, policy)
        if self.bulk is None:
            self.bulk = bulk_observable(child)
            if not self.bulk:
                logger.warning("treespec: prometheus_client's histogram layout is not the one known here: the "
                               "treespec:tree_size / accept_length histograms observe one value at a time")
        observe_all(child, values, self.bulk)


def enable_scheduler(labels: Mapping) -> SchedulerSeries:
    """Create this process's series (once; SGLang's scheduler calls its collector init once)."""
    global _scheduler
    if _scheduler is None:
        _scheduler = SchedulerSeries(labels)
    return _scheduler


def scheduler_series() -> Optional[SchedulerSeries]:
    """This process's series, or None where metrics are off (or on a non-logging rank)."""
    return _scheduler


def enable_tokenizer(labels: Mapping) -> None:
    global _refused
    if _refused is None:
        from prometheus_client import Counter

        lab = _labels(labels)
        _refused = (Counter("treespec:refused_requests", "Requests refused for a bad custom_params['treespec']",
                            [*lab, "field"]), lab)


_FIELD = re.compile(r"^custom_params\['treespec'\]: (?:request \d+: )?([a-z0-9_]+)(\.[a-z_]+)?(:? )")


def refused_field(message: str) -> str:
    """The field a refusal names: ``salf.budget``, ``c2t.classifier``, ``policy``, ``token_cap``, or the
    policy alone for an unknown parameter (``salf``); ``other`` when no registered policy's field can be read
    (the label's values stay bounded whatever a client sends).

    Examples
    --------
    >>> refused_field("custom_params['treespec']: salf.budget must be in [1, 1024], got 0")
    'salf.budget'
    >>> refused_field("custom_params['treespec']: policy must be one of ['c2t', ...], got 'nope'")
    'policy'
    """
    m = _FIELD.match(str(message))
    if m is None:
        return "other"
    head, sub = m.group(1), m.group(2) or ""
    if head in ("policy", "token_cap"):
        return head if not sub else "other"
    # a label names a registered policy and one of its fields, never a client's string: bounded series
    from ..policies.registry import REGISTRY

    reg = REGISTRY.get(head)
    if reg is None:
        return "other"
    return head + sub if not sub or sub[1:] in reg.Params.field_names() else head


def count_refused(message: str) -> None:
    """Count one refused request in this (tokenizer) process, if metrics are on here."""
    if _refused is not None:
        counter, lab = _refused
        counter.labels(**lab, field=refused_field(message)).inc()
