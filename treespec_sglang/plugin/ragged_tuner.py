"""Ragged or padded verify per batch size, chosen by timing both (``TREESPEC_RAGGED_VERIFY=tuned``, and ``auto`` on
the CPU; no sglang import).

A ragged verify (:mod:`.ragged`) runs only the kept nodes, but on a GPU it runs eagerly (the target's CUDA graphs
were captured for ``bs * N`` tokens) and reads the batch's sizes on the host; a padded verify replays the graph
over every node. Which is faster depends on the model, the card, the batch size and the trees, so the tuner
measures both on the running server and verifies each batch size the faster way:

- **Buckets**: batch sizes ``1 | 2-3 | 4-7 | 8-15 | ...`` at each verify width N (:func:`bucket`), each decided
  on its own: SGLang's adaptive speculation moves a chain server's N between rounds, and a padded verify of
  N = 2 timed against a ragged one of N = 8 (or the reverse) would decide nothing about either.
- **Warm-up**: a bucket's first ``2 * warmup`` verifies alternate padded, ragged, padded, ... .
- **Then** the bucket runs its decided path, and one verify in ``explore_every`` the other one (to follow the
  load as contexts grow and the policy mix changes): at most ``1 / explore_every`` of its verifies take the
  slower path once decided. Undecided (samples still in flight) means padded, SGLang's own path.
- **Passed on**: a ragged turn of the warm-up or the exploration whose batch has nothing to compact (every tree
  at N: it runs padded, no sample) passes to the bucket's next verify, at most ``warmup`` times in a row.
  Otherwise a load whose first batches keep every node (eagle2 or talon at budget N) spends the warm-up's ragged
  turns on them, decides with too few ragged samples, then gathers them one in ``explore_every``; a load that
  never compacts reads its sizes on at most ``1 + warmup`` verifies per turn.
- **Timing**: each verify forward (the whole hook path: compaction, re-plan, forward, scatter) between two
  CUDA events on the forward's stream, read back only once finished (``Event.query``: no device sync); on
  the CPU with ``perf_counter``. Each path keeps an exponential mean per bucket (weight ``smoothing``).
- **Decision**: each sample of the other path is divided by the current path's mean at the time it arrives (a
  path run every verify has a current mean; the other one's mean would lag behind a growing context), and the
  bucket switches when the exponential mean of those ratios is below ``1 - margin``; after a switch the ratio
  is measured afresh, over at least ``warmup`` samples.
- **Ranks**: every rank of the verify group must run the same path (the forward's shape). The schedule
  depends only on counts every rank shares; the decisions are rank 0's, broadcast on the group's CPU
  channel every ``agree_every`` verifies (no device sync); alone, a decision takes effect at once.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Deque, Dict, Iterator, List, Optional, Tuple

import torch

from .settings import derived, env

__all__ = ["TunerOptions", "RaggedTuner", "HostClock", "DeviceClock", "bucket", "clock_for", "tuner", "tuning",
           "ENV_TUNING"]

ENV_TUNING = "TREESPEC_RAGGED_TUNING"
logger = logging.getLogger("treespec_sglang.plugin")


@dataclass(frozen=True)
class TunerOptions:
    """``TREESPEC_RAGGED_TUNING``, e.g. ``"warmup=4,explore_every=128"`` (every field optional)."""

    warmup: int = 4  # verifies of each path per bucket before its first decision
    explore_every: int = 128  # once decided, one verify in this many runs the other path
    agree_every: int = 64  # verifies (all buckets) between agreements of the decisions across ranks
    margin: float = 0.03  # switch when the other path runs below (1 - margin) x this one's time (mean ratio)
    smoothing: float = 0.25  # the weight of a new sample in a path's mean

    def __post_init__(self):
        for name in ("warmup", "explore_every", "agree_every"):
            if not 1 <= getattr(self, name) <= 1_000_000:
                raise ValueError(f"{ENV_TUNING}: {name} must be an integer in [1, 1000000], got {getattr(self, name)}")
        if self.explore_every < 2:
            raise ValueError(f"{ENV_TUNING}: explore_every must be >= 2 (1 would never run the decided path)")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"{ENV_TUNING}: margin must be in [0, 1), got {self.margin}")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"{ENV_TUNING}: smoothing must be in (0, 1], got {self.smoothing}")

    @classmethod
    def parse(cls, raw: str) -> "TunerOptions":
        """``"warmup=4, margin=0.05"`` -> options; an unknown field or a bad value raises ValueError naming it."""
        kinds = {f.name: (float if f.type in ("float", float) else int) for f in fields(cls)}
        values = {}
        for part in filter(None, (p.strip() for p in raw.split(","))):
            name, eq, value = (s.strip() for s in part.partition("="))
            if not eq or name not in kinds:
                raise ValueError(f"{ENV_TUNING}: expected name=value with a name in {sorted(kinds)}, got {part!r}")
            if name in values:
                raise ValueError(f"{ENV_TUNING}: {name} given twice")
            try:
                values[name] = kinds[name](value)
            except ValueError:
                raise ValueError(f"{ENV_TUNING}: {name} must be {'an integer' if kinds[name] is int else 'a number'}, "
                                 f"got {value!r}") from None
        return cls(**values)


def bucket(bs: int, n: int) -> Tuple[int, int]:
    """The bucket of a verify of ``bs`` requests at width ``n`` (SGLang's N): ``(bs.bit_length(), n)``, the batch
    sizes ``1 | 2-3 | 4-7 | 8-15 | ...`` at each N. Example: ``bucket(5, 8) == (3, 8)``."""
    if bs < 1:
        raise ValueError(f"batch size must be >= 1, got {bs}")
    if n < 1:
        raise ValueError(f"verify width N must be >= 1, got {n}")
    return bs.bit_length(), n


def _span(key: Tuple[int, int]) -> str:
    """A bucket as the table and the log name it: ``(3, 8)`` -> ``"4-7, N 8"``."""
    b, n = key
    lo, hi = 1 << (b - 1), (1 << b) - 1
    return f"{lo}, N {n}" if lo == hi else f"{lo}-{hi}, N {n}"


class HostClock:
    """Wall time around a verify forward that has finished when it returns (the CPU)."""

    def __init__(self):
        self.done: List[Tuple[object, float]] = []

    def begin(self):
        return time.perf_counter()

    def end(self, start, key) -> None:
        self.done.append((key, (time.perf_counter() - start) * 1e3))

    def cancel(self, start) -> None:
        pass

    def finished(self) -> List[Tuple[object, float]]:
        """``(key, ms)`` of every timed forward finished since the last call."""
        out, self.done = self.done, []
        return out


class DeviceClock:
    """CUDA events around a verify forward on the current stream; read once the end event has completed.

    Event pairs are reused; an in-flight pair is polled with ``Event.query`` (no device sync)."""

    def __init__(self):
        self.free: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.pending: Deque[Tuple[object, torch.cuda.Event, torch.cuda.Event]] = collections.deque()

    def begin(self):
        pair = self.free.pop() if self.free else (torch.cuda.Event(enable_timing=True),
                                                  torch.cuda.Event(enable_timing=True))
        pair[0].record()
        return pair

    def end(self, pair, key) -> None:
        pair[1].record()
        self.pending.append((key, *pair))

    def cancel(self, pair) -> None:
        self.free.append(pair)  # its start event may be recorded again

    def finished(self) -> List[Tuple[object, float]]:
        out = []
        while self.pending and self.pending[0][2].query():
            key, start, stop = self.pending.popleft()
            out.append((key, start.elapsed_time(stop)))
            self.free.append((start, stop))
        return out


def clock_for(device):
    """:class:`DeviceClock` for a CUDA device (the forward runs asynchronously), else :class:`HostClock`."""
    return DeviceClock() if torch.device(device).type == "cuda" else HostClock()


@dataclass
class _Bucket:
    verifies: int = 0  # verifies seen at this bucket (the same on every rank)
    mean: List[Optional[float]] = field(default_factory=lambda: [None, None])  # ms: padded, ragged
    samples: List[int] = field(default_factory=lambda: [0, 0])
    ratio: Optional[float] = None  # mean of (other path's sample / current path's mean when it arrived)
    ratios: int = 0  # samples in ``ratio`` since the last switch
    ragged: bool = False  # the agreed decision
    passed: int = 0  # ragged turns passed on in a row (nothing to compact)


class RaggedTuner:
    """Chooses padded or ragged for each verify (module docstring): :meth:`choose`, then the forward inside
    :meth:`timed`.

    Parameters
    ----------
    options : :class:`TunerOptions`
    clock : :class:`HostClock` / :class:`DeviceClock` (None: chosen by the first forward's device)
    contrary : a test-only fault: this rank proposes the opposite of what it measured (its proposals must
        never be used when it is not rank 0)
    """

    def __init__(self, options: Optional[TunerOptions] = None, clock=None, contrary: bool = False):
        self.options = options or TunerOptions()
        self.clock = clock
        self.contrary = contrary
        self.buckets: Dict[Tuple[int, int], _Bucket] = {}  # bucket(bs, n) -> its state
        self.verifies = 0  # all buckets (the agreement's schedule)

    def choose(self, bs: int, n: int, group=None) -> bool:
        """True: verify this batch of ``bs`` requests at width ``n`` ragged. Identical on every rank of ``group`` (a
        ``GroupCoordinator``)."""
        self._collect()
        size = 1 if group is None else int(getattr(group, "world_size", 1))
        if size > 1 and self.verifies % self.options.agree_every == 0:
            self._agree(group)
        self.verifies += 1
        key = bucket(bs, n)
        b = self.buckets.setdefault(key, _Bucket())
        if size <= 1:
            self._decide(key, b, self.proposal(b))
        seen, o = b.verifies, self.options
        b.verifies += 1
        if seen < 2 * o.warmup:
            return seen % 2 == 1  # padded, ragged, padded, ...
        return b.ragged != (seen % o.explore_every == o.explore_every - 1)

    @contextlib.contextmanager
    def timed(self, bs: int, n: int, ragged: bool, device) -> Iterator[SimpleNamespace]:
        """Time the verify forward run inside as a sample of ``ragged`` at the bucket of ``bs`` requests at width
        ``n``; not one when it fails or sets ``kept = False`` on the object it is given (e.g. it ran the other path
        after all)."""
        if self.clock is None:
            self.clock = clock_for(device)
        start = self.clock.begin()
        sample = SimpleNamespace(kept=True)
        try:
            yield sample
        except BaseException:  # a failed forward is no sample: its clock pair (a device's two events) goes back
            self.clock.cancel(start)
            raise
        key = bucket(bs, n)
        b = self.buckets.get(key)
        if sample.kept:
            self.clock.end(start, (key, int(ragged)))
        else:
            self.clock.cancel(start)
        if b is not None:  # chosen by :meth:`choose` (identical on every rank, as ``kept`` is: the batch's trees)
            turn = ragged and (b.verifies - 1 < 2 * self.options.warmup or not b.ragged)  # warm-up or exploration
            if turn and not sample.kept and b.passed < self.options.warmup:
                b.verifies -= 1  # the next verify takes this ragged turn again
                b.passed += 1
            else:
                b.passed = 0

    def proposal(self, b: _Bucket) -> bool:
        """This rank's view of bucket ``b``: ragged or padded (the current decision until both paths have
        ``warmup`` samples and, since the last switch, ``warmup`` ratios: on a GPU the old path's verifies still
        in flight at a switch arrive after it; switched only past the margin)."""
        if min(b.samples) < self.options.warmup or b.ratios < self.options.warmup:
            want = b.ragged
        else:
            want = (not b.ragged) if b.ratio < 1.0 - self.options.margin else b.ragged
        return want != self.contrary

    def table(self) -> Dict[str, dict]:
        """Per bucket: the decision, each path's mean ms and sample count (tests, benchmarks, debugging)."""
        self._collect()
        return {_span(k): {"ragged": b.ragged, "padded_ms": b.mean[0], "ragged_ms": b.mean[1], "ratio": b.ratio,
                           "samples": list(b.samples), "verifies": b.verifies}
                for k, b in sorted(self.buckets.items())}

    def _collect(self) -> None:
        a = self.options.smoothing
        for (k, path), ms in self.clock.finished() if self.clock is not None else ():
            b = self.buckets.setdefault(k, _Bucket())
            cur = b.mean[int(b.ragged)]
            if path != int(b.ragged) and cur:  # the other path against the current one, now
                r = ms / cur
                b.ratio = r if b.ratio is None else (1.0 - a) * b.ratio + a * r
                b.ratios += 1
            old = b.mean[path]
            b.mean[path] = ms if old is None else (1.0 - a) * old + a * ms
            b.samples[path] += 1

    def _agree(self, group) -> None:
        """Rank 0's proposals on every rank (host-only broadcast on the group's CPU channel), with its count of
        verifies: a rank out of step (e.g. restarted) raises RuntimeError instead of running another path."""
        own = {"verifies": self.verifies, "ragged": {k: self.proposal(b) for k, b in self.buckets.items()}}
        agreed = group.broadcast_object(own, src=0)
        if agreed["verifies"] != self.verifies:
            raise RuntimeError(f"treespec ragged verify: this rank has run {self.verifies} tuned verifies, rank 0 "
                               f"{agreed['verifies']}: the ranks are out of step")
        for k, want in agreed["ragged"].items():
            self._decide(k, self.buckets.setdefault(k, _Bucket()), bool(want))

    def _decide(self, k: Tuple[int, int], b: _Bucket, ragged: bool) -> None:
        if ragged != b.ragged:
            logger.info("treespec ragged verify, batch size %s: %s (padded %s ms, ragged %s ms a verify)",
                        _span(k), "ragged" if ragged else "padded", _ms(b.mean[0]), _ms(b.mean[1]))
            b.ratio, b.ratios = None, 0  # the other path is now the one left: its ratio is measured afresh
        b.ragged = ragged


def _ms(x: Optional[float]) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.3f}"


_TUNER: List[Optional[RaggedTuner]] = [None]  # one per process (one scheduler, one target)


@derived
def tuning() -> TunerOptions:
    """``TREESPEC_RAGGED_TUNING`` parsed (checked at server start and compared across ranks)."""
    return TunerOptions.parse(env(ENV_TUNING))


def tuner(contrary: bool = False) -> RaggedTuner:
    """The process's tuner, made on first use with :func:`tuning`."""
    if _TUNER[0] is None:
        _TUNER[0] = RaggedTuner(tuning(), contrary=contrary)
    return _TUNER[0]
