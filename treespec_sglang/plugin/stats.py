"""Per-request ``treespec_*`` stats on streamed responses (hook body; imports nothing of sglang).

SGLang 0.5.23 sends a request-level ``customized_info`` key of a *streamed* request with its first
chunk only (``_GenerationStreamAccumulator.accept``: ``if req.stream and send_token_offset != 0:
continue``), before any verify round has run, so a stream never saw our per-round lists. The
tokenizer manager, on the other hand, *extends* a key's accumulated list with every chunk's values
(``_accumulate_request_meta_info``). So for a streamed request this hook sends each chunk the rounds
recorded since the previous chunk (the delta), and the client's last chunk carries the whole list,
exactly what a non-streamed response carries.

Worked example: rounds recorded 3, 1 | 4, 2, 2 | 5 across three chunks -> the chunks carry
``[3, 1]``, ``[4, 2, 2]``, ``[5]``; the tokenizer manager accumulates ``[3, 1, 4, 2, 2, 5]``.
Non-streamed requests are left to SGLang (request-level keys go out once, when the request finishes).

Bounded: the per-round lists keep their first ``TREESPEC_STATS_MAX_ROUNDS`` values (default 4096); the
``treespec_summary`` (one dict: rounds, tree nodes, verified tokens, accepted draft tokens, and whether
the lists were cut) always covers every round. A stream carries the summary with its last chunk only.
The Prometheus series (:mod:`.metrics`) are fed by the same call, so they equal these sums.
"""

from __future__ import annotations

import collections
from typing import Deque, Dict, Optional, Sequence

import torch

from .metrics import scheduler_series
from .settings import derived, env
from ..policies.registry import registration_of

__all__ = ["PREFIX", "SUMMARY", "ROUND_KEYS", "stream_accept", "record_round", "record_rounds", "max_rounds",
           "PendingSizes", "policy_name"]

PREFIX = "treespec_"
SUMMARY = "treespec_summary"
# per-round list key -> (the summary total it adds to, the metrics series method it feeds)
ROUND_KEYS = {"treespec_tree_sizes": ("tree_nodes", "drafted"),
              "treespec_verify_tokens": ("verified_tokens", "verified_tokens"),
              "treespec_accept_lengths": ("accepted_tokens", "accepted_round")}
ENV_MAX_ROUNDS = "TREESPEC_STATS_MAX_ROUNDS"
_SENT = "_treespec_sent"  # on the Req: {key: how many values earlier chunks carried}


@derived
def max_rounds() -> int:
    """The per-round lists' cap (``TREESPEC_STATS_MAX_ROUNDS``, default 4096; 0 keeps summaries only); parsed
    once per settings snapshot (:func:`.settings.derived`): record_rounds asks every round."""
    raw = env(ENV_MAX_ROUNDS).strip()
    try:
        n = int(raw) if raw else 4096
    except ValueError:
        raise ValueError(f"{ENV_MAX_ROUNDS} must be an integer >= 0, got {raw!r}") from None
    if n < 0:
        raise ValueError(f"{ENV_MAX_ROUNDS} must be an integer >= 0, got {n}")
    return n


def record_round(req, policy: str, key: str, value: int) -> None:
    """Add one round's ``value`` under ``key`` (one of :data:`ROUND_KEYS`) to the request's stats.

    The first value of a request also sets ``treespec_policy`` and counts the request in the metrics.
    Example: tree sizes 4, 6 then accept lengths 2, 3 -> ``treespec_tree_sizes [4, 6]``,
    ``treespec_accept_lengths [2, 3]``, summary ``{"rounds": 2, "tree_nodes": 10, "accepted_tokens": 5, ...}``.
    """
    record_rounds([req], [policy], key, [value])


def record_rounds(reqs: Sequence, policies: Sequence[Optional[str]], key: str, values: Sequence[int]) -> None:
    """:func:`record_round` for one round of a batch: ``values[i]`` for ``reqs[i]`` under its policy
    ``policies[i]`` (None: not ours, skipped). The environment, the metrics series and ``key``'s columns are
    looked up once per call, not per request: a hook calls this once per round for the whole batch."""
    if not any(policies):  # a native batch (names are never empty)
        return
    cap, series = max_rounds(), scheduler_series()
    total, method = ROUND_KEYS[key]
    rounds = key == "treespec_accept_lengths"
    by_policy: Dict[str, list] = {}  # the round's values per policy, for the series (one call per policy)
    for req, policy, value in zip(reqs, policies, values):
        if policy is None:
            continue
        info = getattr(req, "customized_info", None)
        if info is None or SUMMARY not in info:
            info = _first_round(req, info, policy, series)
        summary = info[SUMMARY][0]
        column = info.get(key)
        if column is None:
            column = info[key] = []
        value = int(value)
        if len(column) < cap:
            column.append(value)
        else:
            summary["lists_truncated"] = True
        summary[total] += value
        if rounds:
            summary["rounds"] += 1
        if series is not None:
            by_policy.setdefault(policy, []).append(value)
    for policy, vals in by_policy.items():
        getattr(series, method)(policy, vals)


def _first_round(req, info: Optional[dict], policy: str, series) -> dict:
    """A request's first recorded value: its ``treespec_policy`` and zero totals, counted in the metrics."""
    info = {} if info is None else info
    info["treespec_policy"] = [policy]
    info[SUMMARY] = [{"rounds": 0, "tree_nodes": 0, "verified_tokens": 0, "accepted_tokens": 0,
                      "lists_truncated": False}]
    req.customized_info = info
    if series is not None:
        series.new_request(policy)
    return info


def stream_accept(original, self, *args, **kwargs):
    """AROUND ``_GenerationStreamAccumulator.accept(self, *, req)``."""
    req = kwargs.get("req", args[0] if args else None)
    info = getattr(req, "customized_info", None)
    if not getattr(req, "stream", False) or not info or not any(str(k).startswith(PREFIX) for k in info):
        return original(self, *args, **kwargs)
    ours = {k: info.pop(k) for k in list(info) if str(k).startswith(PREFIX)}
    n_before = len(self.rids)
    try:
        out = original(self, *args, **kwargs)
    finally:
        info.update(ours)
    if len(self.rids) == n_before:  # this step emits no chunk for the request: send later
        return out
    sent = getattr(req, _SENT, None)
    if sent is None:
        sent = {}
        setattr(req, _SENT, sent)
    row = len(self.rids) - 1  # the chunk the original just appended for this request
    for key, values in ours.items():
        values = list(values or [])
        if key == SUMMARY:  # totals, not a list of rounds: the last chunk carries them, once
            delta = [dict(v) for v in values] if req.finished() else []
        else:
            delta = values[min(sent.get(key, 0), len(values)):]  # treespec_policy (one value) goes once
        column = self.customized_info.setdefault(key, [[] for _ in range(row)])
        while len(column) <= row:
            column.append([])
        column[row] = delta
        sent[key] = len(values)
    return out


def policy_name(p) -> str:
    """The registered name of a request's policy: ``TalonParams(...)`` -> ``"talon"`` (its stats and metrics label)."""
    return registration_of(p).name


class PendingSizes:
    """Tree sizes of the rounds drafted but not yet recorded, read back without stalling the device.

    At draft time the ``[bs]`` sizes are copied to the host asynchronously (pinned memory, an event
    after the copy); :meth:`flush` records every round whose copy has finished, oldest first. It runs
    when SGLang resolves a round's accepted tokens (by then that round's draft is done on the stream) and
    before each draft. On the CPU the copy is the tensor itself and is ready at once.
    """

    def __init__(self):
        self.rounds: Deque[tuple] = collections.deque()  # (reqs, policies, host sizes [bs], ready())

    def push(self, reqs, policies, sizes: torch.Tensor) -> None:
        """One round's ``[bs]`` tree sizes for ``reqs``, recorded under ``policies`` (names; None: not ours)."""
        if sizes.device.type == "cpu":
            host, ready = sizes, (lambda: True)
        else:
            host = torch.empty(sizes.shape, dtype=sizes.dtype, pin_memory=True)
            host.copy_(sizes, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            ready = event.query
        self.rounds.append((reqs, policies, host, ready))

    def flush(self) -> None:
        while self.rounds and self.rounds[0][3]():
            reqs, policies, host, _ = self.rounds.popleft()
            record_rounds(reqs, policies, "treespec_tree_sizes", host.tolist())  # a finished host copy: no sync
