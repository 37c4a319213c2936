"""Per-request ``treespec_*`` stats on streamed responses (hook body; imports nothing of sglang).

SGLang 0.5.23 sends a request-level ``customized_info`` key of a *streamed* request with its first
chunk only (``_GenerationStreamAccumulator.accept``: ``if req.stream and send_token_offset != 0:
continue``), before any verify round has run, so a stream never saw our per-round lists. The
tokenizer manager, on the other hand, *extends* a key's accumulated list with every chunk's values
(``_accumulate_request_meta_info``). So for a streamed request this hook sends each chunk the rounds
recorded since the previous chunk (the delta), and the client's last chunk carries the whole list,
exactly what a non-streamed response carries. A round's tree size and verify tokens go out with its accept
length: they are recorded a round ahead under the overlap scheduler, and a retraction may take that round back.

Worked example: rounds recorded 3, 1 | 4, 2, 2 | 5 across three chunks -> the chunks carry
``[3, 1]``, ``[4, 2, 2]``, ``[5]``; the tokenizer manager accumulates ``[3, 1, 4, 2, 2, 5]``.
Non-streamed requests are left to SGLang (request-level keys go out once, when the request finishes).

Bounded: the per-round lists keep their first ``TREESPEC_STATS_MAX_ROUNDS`` values (default 4096); the
``treespec_summary`` (one dict: rounds, tree nodes, verified tokens, accepted draft tokens, and whether
the lists were cut) always covers every round. It is derived from the lists when the request finishes
(:func:`summary_of`), the one time it is sent: a stream carries it with its last chunk only.
The Prometheus series (:mod:`.metrics`) are fed by the same call, so they equal these sums.

Host cost per round: each key's values are appended to the batch's cached per-request lists
(:class:`BatchStats`) in C, with no per-request Python. A batch whose requests or policies changed (most rounds
at high concurrency: requests finish and join) finds its members again in C-level passes, shared by the three
keys (:class:`_Members`); only a request's first round builds its :class:`RequestStats` in Python. A streamed
request's output hook (:func:`stream_accept`) costs the same every chunk, whatever the stream's length.
"""

from __future__ import annotations

import collections
import itertools
import operator
from typing import Deque, Dict, Optional, Sequence

from . import batch_diff
from .batch_diff import diff
from .metrics import scheduler_series
from .round import same_requests
from .settings import derived, env
from ..policies.registry import registration_of

__all__ = ["PREFIX", "SUMMARY", "ROUND_KEYS", "FOLD", "stream_accept", "record_round", "record_rounds", "summary_of",
           "max_rounds", "RequestStats", "BatchStats", "policy_name"]

PREFIX = "treespec_"
SUMMARY = "treespec_summary"
# per-round list key -> (the summary total it adds to, the metrics series method it feeds)
ROUND_KEYS = {"treespec_tree_sizes": ("tree_nodes", "drafted"),
              "treespec_verify_tokens": ("verified_tokens", "verified_tokens"),
              "treespec_accept_lengths": ("accepted_tokens", "accepted_round")}
ACCEPTS = "treespec_accept_lengths"
_KEYS = ("treespec_policy", *ROUND_KEYS, SUMMARY)  # every key a request's stats put in its customized_info
ENV_MAX_ROUNDS = "TREESPEC_STATS_MAX_ROUNDS"
FOLD = 4096  # values past the cap kept before they are folded into a total
_STATS = "_treespec_stats"  # on the Req: its RequestStats
_LAST: Dict[str, "BatchStats"] = {}  # per key, the last batch recorded (one decode batch per scheduler process)
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
    ``treespec_accept_lengths [2, 3]``, summary (:func:`summary_of`) ``{"rounds": 2, "tree_nodes": 10,
    "accepted_tokens": 5, ...}``.
    """
    record_rounds([req], [policy], key, [int(value)])


def record_rounds(reqs: Sequence, policies: Sequence[Optional[str]], key: str, values: Sequence[int]) -> None:
    """:func:`record_round` for one round of a batch: ``values[i]`` (a Python int: a host list, ``.tolist()`` or
    SGLang's) for ``reqs[i]`` under its policy ``policies[i]`` (None: not ours, skipped). A hook calls this once
    per round and key for the whole batch: while the batch holds the same requests under the same policies its
    :class:`BatchStats` is reused, so a round costs an identity check and one append per request, both in C."""
    if not any(policies):  # a native batch (names are never empty)
        return
    cap, last = max_rounds(), _LAST.get(key)
    if last is None or not last.holds(reqs, policies, cap):
        last = _LAST[key] = BatchStats(key, reqs, policies, cap, last)
    last.record(values, scheduler_series())


def uncommitted(req) -> None:
    """A retracted request's round (SGLang commits nothing for it): its tree size and verify tokens, recorded when
    it was drafted and verified, are cut now (:meth:`RequestStats.close`), so the lists stay aligned round by
    round when the request runs on after its prefill again."""
    stats = getattr(req, _STATS, None)
    if stats is not None:
        stats.close()


def summary_of(req) -> Optional[dict]:
    """The finished request's ``treespec_summary`` brought up to date (None: not ours), its lists closed
    (:meth:`RequestStats.close`). The totals are derived from the per-round lists, not kept per round:
    :func:`stream_accept` calls this when the request finishes, the one time the summary is sent (a stream's
    last chunk, or a non-streamed response)."""
    stats = getattr(req, _STATS, None)
    if stats is None:
        return None
    stats.close()
    summary = stats.summary()
    stats.info[SUMMARY] = [summary]
    return summary


class RequestStats:
    """One request's per-round values under each of :data:`ROUND_KEYS`.

    ``lists[key]`` is the list its ``customized_info`` carries (the first ``cap`` values, appended in place); a
    value past the cap goes to ``overflow[key]``, folded into ``folded[key]`` (count, total) every
    :data:`FOLD` values, so a long request's memory stays bounded while the summary still counts every round.
    """

    __slots__ = ("info", "lists", "overflow", "folded")

    def __init__(self, req, policy: str, series):
        info = getattr(req, "customized_info", None)
        self.info = info = {} if info is None else info
        info["treespec_policy"] = [policy]
        self.lists = {key: info.setdefault(key, []) for key in ROUND_KEYS}
        self.overflow = {key: [] for key in ROUND_KEYS}
        self.folded = {key: (0, 0) for key in ROUND_KEYS}
        req.customized_info = info
        setattr(req, _STATS, self)
        self.info[SUMMARY] = [self.summary()]
        if series is not None:
            series.new_request(policy)

    def sink(self, key: str, cap: int) -> tuple:
        """``(the list key's next values go to, how many more it takes)``: the visible list below the cap, else
        the overflow (folded first when full)."""
        visible = self.lists[key]
        if len(visible) < cap:
            return visible, cap - len(visible)
        over = self.overflow[key]
        if len(over) >= FOLD:
            n, total = self.folded[key]
            self.folded[key] = (n + len(over), total + sum(over))
            over.clear()  # in place: a batch's sinks keep pointing at it
        return over, FOLD - len(over)

    def count(self, key: str) -> int:
        """How many values ``key`` recorded: the list, the overflow and what was folded."""
        return self.folded[key][0] + len(self.lists[key]) + len(self.overflow[key])

    def close(self) -> None:
        """At the request's finish: drop the tree sizes and verify tokens of rounds past its last accepted one.

        Under SGLang's overlap scheduler round n + 1 is drafted and verified before round n's result is
        processed, so a request that stops at round n (an EOS: only length stops are known in advance) was
        drafted and verified once more, and that round commits nothing (its accept length is never recorded).
        Those values are the last ones: they are cut from the end, so the response's three lists stay aligned
        round by round. (The Prometheus series, fed as rounds run, count that verify's work.) A retracted
        request's uncommitted round is cut the same way when its result is processed (:func:`uncommitted`):
        it runs on after its prefill again, so its finish would cut a later round instead.
        """
        rounds = self.count(ACCEPTS)
        for key in ROUND_KEYS:
            extra = self.count(key) - rounds
            for values in (self.overflow[key], self.lists[key]):  # in place: sinks and customized_info hold them
                cut = min(extra, len(values))
                if cut > 0:
                    del values[len(values) - cut:]
                    extra -= cut

    def summary(self) -> dict:
        """The totals over every round recorded: the lists, the overflow and what was folded."""
        out = {"rounds": self.count(ACCEPTS)}
        for key, (total, _) in ROUND_KEYS.items():
            out[total] = self.folded[key][1] + sum(self.lists[key]) + sum(self.overflow[key])
        out["lists_truncated"] = any(self.overflow[k] or self.folded[k][0] for k in ROUND_KEYS)
        return out


class _Members:
    """The requests of a batch (``reqs``, the same objects in order) that are ours under ``policies`` (names; None:
    not ours): ``stats`` their :class:`RequestStats` (a request's first round creates it), ``pick`` (None: all
    are ours) takes theirs from a round's values, ``groups`` policy -> the positions among ours (None: all) for
    the metrics, ``lists`` each one's :attr:`RequestStats.lists` (both read the first time they are asked for:
    once for the three keys, and never without the metrics). One batch's three keys share it: built once in O(bs)
    Python when the batch's requests or policies change."""

    __slots__ = ("reqs", "policies", "stats", "pick", "ours", "_names", "_groups", "_lists")

    def __init__(self, reqs: tuple, policies: tuple, base: Optional["_Members"] = None):
        self.reqs, self.policies = reqs, policies
        # ours from a round's values, when not all (names are str, compared with None in C; record_rounds makes
        # no members for a batch with none of ours)
        self.pick = _getter(_where(map(operator.is_not, policies, _NONES))) if policies.count(None) else None
        self.ours, names = (reqs, policies) if self.pick is None else (self.pick(reqs), self.pick(policies))
        series = scheduler_series()
        change = None if base is None or len(self.ours) < batch_diff.FEWEST else diff(base.ours, self.ours)
        if change is not None:  # the batch before's members, changed by a few runs (.batch_diff): theirs sliced,
            # the new ones' read (a request's policy never changes: one kept is ours under the same name)
            self.stats = change.apply(base.stats, lambda i, j: map(_stats_of, self.ours[i:j], names[i:j],
                                                                  itertools.repeat(series)))
        else:
            stats = list(map(getattr, self.ours, itertools.repeat(_STATS), _NONES))  # in C: most have theirs already
            for j in _where(map(operator.is_, stats, _NONES)):  # a request's first round
                stats[j] = RequestStats(self.ours[j], names[j], series)
            self.stats = stats
        self._names, self._groups, self._lists = names, None, None

    @property
    def groups(self) -> dict:
        """Policy name -> a getter of its members' values from ours (None: every member is of that policy)."""
        if self._groups is None:
            kinds, names = set(self._names), self._names
            if len(kinds) == 1:  # one policy (a server default's, say): every member, found without a pass
                self._groups = dict.fromkeys(kinds)
            else:  # each policy a part of them
                self._groups = {name: _getter(_where(map(operator.eq, names, itertools.repeat(name))))
                                for name in kinds}
        return self._groups

    @property
    def lists(self) -> list:
        """Each member's :attr:`RequestStats.lists` (a dict that lives as long as its request), read in C the first
        time a key looks its sinks up."""
        if self._lists is None:
            self._lists = list(map(_LISTS, self.stats))
        return self._lists

    def holds(self, reqs: Sequence, policies: Sequence[Optional[str]]) -> bool:
        """Whether these are the members of ``reqs`` (the same objects, in order: identity in C) under
        ``policies``."""
        return same_requests(reqs, self.reqs) and (policies is self.policies or tuple(policies) == self.policies)


_MEMBERS: Deque[_Members] = collections.deque(maxlen=2)  # the last batches' (a round's sizes may follow the next)


def _members(reqs: Sequence, policies: Sequence[Optional[str]]) -> _Members:
    """The members of ``reqs`` under ``policies``: a recent batch's when it holds them, else built."""
    recent = tuple(_MEMBERS)  # a snapshot: never iterated while another caller appends
    for m in recent:
        if m.holds(reqs, policies):
            return m
    m = _Members(tuple(reqs), tuple(policies), recent[-1] if recent else None)
    _MEMBERS.append(m)
    return m


def _stats_of(req, policy: str, series) -> "RequestStats":
    """The request's :class:`RequestStats`, made at its first round."""
    return getattr(req, _STATS, None) or RequestStats(req, policy, series)



_LISTS = operator.attrgetter("lists")


class BatchStats:
    """A batch's stats columns for one key: each of its requests' sink (:meth:`RequestStats.sink`), in batch
    order, over the batch's :class:`_Members` (shared by the keys). A round appends its values in C. ``room``
    counts the rounds every sink still takes; at 0 the sinks are looked up again (a list reached the cap, or
    an overflow is folded)."""

    __slots__ = ("key", "cap", "members", "sinks", "room")

    def __init__(self, key: str, reqs: Sequence, policies: Sequence[Optional[str]], cap: int,
                 last: Optional["BatchStats"] = None):
        self.key, self.cap, self.members = key, cap, _members(reqs, policies)
        self.sinks, self.room = (), 0
        if last is not None and last.cap == cap and len(self.members.ours) >= batch_diff.FEWEST:
            change = diff(last.members.ours, self.members.ours)
            if change is not None:  # the key's batch before, changed by a few runs: its sinks sliced
                self._carry(last, change)

    def _carry(self, last: "BatchStats", change) -> None:
        """The sinks of ``last`` (this key's batch before, ``change`` away) for the members it kept, the new
        members' looked up; the room what both still take."""
        stats, rooms = self.members.stats, [last.room]

        def fresh(i, j):
            looked = [st.sink(self.key, self.cap) for st in stats[i:j]]
            rooms.extend(n for _, n in looked)
            return [s for s, _ in looked]

        self.sinks = change.apply(last.sinks, fresh)
        self.room = min(rooms)

    def holds(self, reqs: Sequence, policies: Sequence[Optional[str]], cap: int) -> bool:
        """Whether this is the batch of ``reqs`` (the same objects, in order: identity in C) under ``policies``."""
        return cap == self.cap and self.members.holds(reqs, policies)

    def _look_up(self) -> None:
        """The sinks again: each member's visible list while every one is below the cap (in C), else each one's
        :meth:`RequestStats.sink`."""
        stats = self.members.stats
        visible = list(map(operator.itemgetter(self.key), self.members.lists))
        longest = max(map(len, visible), default=0)
        if longest < self.cap:
            self.sinks, self.room = visible, self.cap - longest
            return
        looked = [st.sink(self.key, self.cap) for st in stats]
        self.sinks, self.room = [s for s, _ in looked], min((n for _, n in looked), default=0)

    def record(self, values: Sequence[int], series) -> None:
        """One round's ``values`` (one per request of the batch; any past the batch's last are not its own):
        appended to the sinks, fed to the series."""
        m = self.members
        if len(values) < len(m.reqs) or (values and type(values[0]) is not int):
            raise ValueError(f"record_rounds({self.key!r}): one Python int per request of the batch, got "
                             f"{len(values)} values of type {type(values[0]).__name__ if values else None} for "
                             f"{len(m.reqs)} requests")
        if m.pick is not None:
            values = m.pick(values)
        elif len(values) != len(m.reqs):
            values = values[:len(m.reqs)]
        if self.room < 1:
            self._look_up()
        collections.deque(map(list.append, self.sinks, values), maxlen=0)
        self.room -= 1
        if series is not None:
            method = getattr(series, ROUND_KEYS[self.key][1])
            for name, ix in m.groups.items():
                method(name, values if ix is None else ix(values))


def stream_accept(original, self, *args, **kwargs):
    """AROUND ``_GenerationStreamAccumulator.accept(self, *, req)``: once per request of every output batch (every
    round of a stream), so its cost is per request and chunk: a request without stats is SGLang's at once, and a
    chunk sets only what SGLang would not (a long stream's whole lists were copied every chunk: quadratic)."""
    req = kwargs.get("req", args[0] if args else None)
    if getattr(req, _STATS, None) is None:  # not ours (our keys come with a request's stats)
        return original(self, *args, **kwargs)
    finished = req.finished()
    if finished:
        summary_of(req)  # the one time it is sent: streamed or not, with the request's last output
    info = getattr(req, "customized_info", None)
    if not getattr(req, "stream", False) or not info:
        return original(self, *args, **kwargs)
    n_before = len(self.rids)
    # our keys are request-level (``_request_level_key``): a stream's first chunk takes them as they are (set
    # again below), a later one leaves an empty row, right for the policy (sent once) and a running summary
    out = original(self, *args, **kwargs)
    if len(self.rids) == n_before:  # this step emits no chunk for the request: send later
        return out
    sent = getattr(req, _SENT, None)
    keys = _KEYS if sent is None or finished else ROUND_KEYS
    if sent is None:
        sent = {}
        setattr(req, _SENT, sent)
    row = len(self.rids) - 1  # the chunk the original just appended for this request
    # a round's tree size and verify tokens go out with its accept length: under the overlap scheduler they are
    # recorded a round ahead, and a retraction takes that round back (a value sent could not be)
    committed = len(info.get(ACCEPTS) or [])
    for key in keys:
        values = info.get(key) or []
        # a round's tree size and verify tokens: up to the rounds committed (slicing, never copying the whole list)
        end = min(len(values), committed) if key in ROUND_KEYS and key != ACCEPTS else len(values)
        if key == SUMMARY:  # totals, not a list of rounds: the last chunk carries them, once
            delta = [dict(v) for v in values] if finished else []
        else:
            delta = values[min(sent.get(key, 0), end):end]  # treespec_policy (one value) goes once
        column = self.customized_info.get(key)
        if column is None:  # the batch's first chunk of ours: the rows before it carry nothing of it
            column = self.customized_info[key] = [[] for _ in range(row)]
        while len(column) <= row:
            column.append([])
        column[row] = delta
        sent[key] = end
    return out


_NONES = itertools.repeat(None)


def _where(flags) -> list:
    """The positions of the true ``flags`` (an iterable of bools), in C."""
    return list(itertools.compress(itertools.count(), flags))


def _getter(positions: Sequence[int]):
    """``values -> tuple(values[i] for i in positions)`` in C (``operator.itemgetter``, a 1-tuple for one)."""
    pick = operator.itemgetter(*positions)
    return pick if len(positions) > 1 else (lambda values: (pick(values),))


def policy_name(p) -> str:
    """The registered name of a request's policy: ``TalonParams(...)`` -> ``"talon"`` (its stats and metrics label)."""
    return registration_of(p).name
