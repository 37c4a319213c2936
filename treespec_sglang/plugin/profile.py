"""Where a speculative round's time goes inside SGLang: every plugin hook against SGLang's own work (operator
environment, off by default; no sglang import).

With ``TREESPEC_PROFILE=DIR`` each SGLang process registers every hook body wrapped in an exclusive timer
(:meth:`Profile.timed`): a hook's time excludes the timed calls inside it, and an AROUND hook's ``original``
(SGLang's own function) is timed as ``sglang:<function>``, so a round's parts add up to the round. A round is
one ``EAGLEWorkerV2.forward_batch_generation`` call; a decode round's kind is ``"ts"`` when it carried a treespec
request, else ``"native"``; a call that prefills (or idles) is a ``"prefill"`` (``"idle"``) round of its own.
Hooks that run between rounds (arrival, result processing, streaming) are charged to the round that follows
them. After each round the process rewrites ``DIR/profile-<pid>.json``::

    {"ts": {"rounds": 120, "round_s": 3.1, "parts": {"hook:_build_verify_input": [0.21, 120], ...}}, "native": ...}

``parts`` maps a part to ``[exclusive seconds, calls]``; ``sglang:`` parts are SGLang's, ``hook:`` parts the
plugin's. Two options, each for a run of its own (they change what they measure):

- ``TREESPEC_PROFILE_OPS=1`` also counts, per plugin hook, the ATen ops and the host reads it runs
  (:func:`treespec_sglang.utils.syncs.count_ops`; SGLang's calls inside an AROUND hook are not counted):
  ``"ops": {"hook:_build_verify_input": [ops, host reads], ...}``.
- ``TREESPEC_PROFILE_SYNC=1`` synchronises the CUDA device at every timed boundary, so a part is charged the
  device time of the work it queued (host time alone otherwise; the CPU is synchronous anyway).

:func:`read_profile` sums the files of every process; ``bench/plugin_round_profile.py`` runs native and
treespec requests on one engine and prints where each extra millisecond goes.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import time
from collections import defaultdict
from typing import Callable, Dict, Optional

from .config import env_switch
from .settings import env

__all__ = ["ENV_PROFILE", "ENV_PROFILE_OPS", "ENV_PROFILE_SYNC", "Profile", "profiled", "read_profile",
           "profile_from_env"]

ENV_PROFILE = "TREESPEC_PROFILE"
ENV_PROFILE_OPS = "TREESPEC_PROFILE_OPS"
ENV_PROFILE_SYNC = "TREESPEC_PROFILE_SYNC"
ROUND = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation"
_READS = ("tolist", "numpy")  # what count_ops patches on torch.Tensor to see host reads (they bypass dispatch)


logger = logging.getLogger("treespec_sglang.plugin")


def _original_reads() -> dict:
    import torch
    return {name: getattr(torch.Tensor, name) for name in _READS}


_ORIGINAL_READS = _original_reads()  # before any count_ops patched them


def _short(target: str) -> str:
    """``a.b.Class.method`` -> ``Class.method``; ``a.b.function`` -> ``b.function``."""
    return ".".join(target.split(".")[-2:])


class Profile:
    """Exclusive timers over one process's hooks, folded into per-kind totals at the end of each round.

    Example
    -------
    >>> p = Profile(out_dir=None)
    >>> inner = p.timed("hook:inner", lambda: 1)
    >>> outer = p.timed("hook:outer", lambda: inner() + 1)
    >>> outer(), sorted(p.pending)  # each call charged to its own name only
    (2, ['hook:inner', 'hook:outer'])
    >>> p.end_round("native", 0.5)["native"]["rounds"]
    1
    """

    def __init__(self, out_dir: Optional[str], count: bool = False, sync: bool = False,
                 clock: Callable[[], float] = time.perf_counter):
        self.out_dir, self.count, self.sync, self.clock = out_dir, count, sync, clock
        self.stack: list = []  # inner seconds charged so far to each open timed call
        self.pending: Dict[str, list] = defaultdict(lambda: [0.0, 0])  # this round's parts
        self.pending_ops: Dict[str, list] = defaultdict(lambda: [0, 0])
        self.totals: Dict[str, dict] = {}

    def _now(self) -> float:
        if self.sync:
            import torch

            from .draft_select import capturing
            # never inside a CUDA graph capture (a sync there is illegal): SGLang captures some hooked calls
            if torch.cuda.is_available() and torch.cuda.is_initialized() and not capturing():
                torch.cuda.synchronize()
        return self.clock()

    def timed(self, name: str, fn: Callable, ops: bool = False) -> Callable:
        """``fn`` charged to ``name`` exclusive of the timed calls it makes; ``ops``: count its ATen ops too."""
        @functools.wraps(fn)
        def run(*args, **kwargs):
            t0 = self._now()
            self.stack.append(0.0)
            c = None
            try:
                if ops and self.count:
                    from ..utils.syncs import count_ops
                    with count_ops() as c:
                        return fn(*args, **kwargs)
                return fn(*args, **kwargs)
            finally:
                inner = self.stack.pop()
                try:
                    end = self._now()
                except Exception as e:  # a failing device sync: host time; the next device op raises it again
                    logger.warning("treespec profile: device sync failed after %s: %s", name, e)
                    end = self.clock()
                dt = end - t0
                part = self.pending[name]
                part[0] += dt - inner
                part[1] += 1
                if self.stack:
                    self.stack[-1] += dt
                if c is not None:
                    self.pending_ops[name][0] += c.ops
                    self.pending_ops[name][1] += c.reads
        return run

    def uncounted(self, fn: Callable) -> Callable:
        """``fn`` run with no op counter active (SGLang's own call inside a counted AROUND hook): the dispatch
        modes are set aside and ``Tensor.tolist`` / ``numpy`` are the originals again, so SGLang's own host
        reads are not the hook's (hooks nested inside count their own, as usual)."""
        if not self.count:
            return fn

        @functools.wraps(fn)
        def run(*args, **kwargs):
            import torch
            from torch.utils._python_dispatch import _disable_current_modes
            patched = {name: getattr(torch.Tensor, name) for name in _READS}
            try:
                for name in _READS:
                    setattr(torch.Tensor, name, _ORIGINAL_READS[name])
                with _disable_current_modes():
                    return fn(*args, **kwargs)
            finally:
                for name, f in patched.items():
                    setattr(torch.Tensor, name, f)
        return run

    def end_round(self, kind: str, seconds: float) -> dict:
        """Fold this round's parts into ``kind``'s totals, write the process's file, return the totals."""
        tot = self.totals.setdefault(kind, {"rounds": 0, "round_s": 0.0, "parts": {}, "ops": {}})
        tot["rounds"] += 1
        tot["round_s"] += seconds
        for name, (s, n) in self.pending.items():
            acc = tot["parts"].setdefault(name, [0.0, 0])
            acc[0] += s
            acc[1] += n
        for name, (o, r) in self.pending_ops.items():
            acc = tot["ops"].setdefault(name, [0, 0])
            acc[0] += o
            acc[1] += r
        self.pending.clear()
        self.pending_ops.clear()
        if self.out_dir:
            path = os.path.join(self.out_dir, f"profile-{os.getpid()}.json")
            try:
                with open(path + ".tmp", "w") as f:
                    json.dump(self.totals, f)
                os.replace(path + ".tmp", path)
            except OSError as e:  # a profile must never take the server down: say so once per failure
                logger.warning("treespec profile: cannot write %s: %s", path, e)
        return self.totals


def profiled(profile: Profile, target: str, kind: str, body: Callable, is_treespec: Callable[[], bool]) -> Callable:
    """A hook body timed as ``hook:<name>``; an AROUND body's ``original`` as ``sglang:<target>``. The round's
    hook (on :data:`ROUND`) also closes the round: its kind is read while the round is still open."""
    name = f"hook:{getattr(body, '__name__', 'hook')}"
    timed_body = profile.timed(name, body, ops=True)
    if kind != "AROUND":
        return timed_body
    sglang_name = f"sglang:{_short(target)}"
    seen: dict = {}

    def original_seen(original):
        def call(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            finally:
                seen["ts"] = is_treespec()  # still inside the round's hook: its round is open
        return call

    @functools.wraps(body)
    def around(original, *args, **kwargs):
        inner = original_seen(original) if target == ROUND else original
        if target != ROUND:
            return timed_body(profile.timed(sglang_name, profile.uncounted(inner)), *args, **kwargs)
        stage = round_stage(args[1] if len(args) > 1 else kwargs.get("batch"))
        t0 = profile._now()
        try:
            return timed_body(profile.timed(sglang_name, profile.uncounted(inner)), *args, **kwargs)
        finally:
            ts = seen.pop("ts", False)
            profile.end_round(stage or ("ts" if ts else "native"), profile._now() - t0)
    return around


def round_stage(batch) -> Optional[str]:
    """``"prefill"`` / ``"idle"`` for a ``forward_batch_generation`` call that is not a decode round (its batch's
    forward mode extends, or is idle), else None (a decode round: ``ts`` or ``native``)."""
    mode = getattr(batch, "forward_mode", None)
    if mode is None:
        return None
    if mode.is_extend() or getattr(batch, "is_extend_in_batch", False):
        return "prefill"
    return "idle" if mode.is_idle() else None


def profile_from_env() -> Optional[Profile]:
    """A :class:`Profile` when ``TREESPEC_PROFILE`` names a directory (created if missing), else None."""
    out = env(ENV_PROFILE)
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    return Profile(out, count=env_switch(ENV_PROFILE_OPS), sync=env_switch(ENV_PROFILE_SYNC))


def read_profile(directory: str) -> Dict[str, dict]:
    """Every process's totals in ``directory`` summed per round kind (``{"ts": {...}, "native": {...}}``)."""
    out: Dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(directory, "profile-*.json"))):
        with open(path) as f:
            for kind, tot in json.load(f).items():
                acc = out.setdefault(kind, {"rounds": 0, "round_s": 0.0, "parts": {}, "ops": {}})
                acc["rounds"] += tot["rounds"]
                acc["round_s"] += tot["round_s"]
                for key in ("parts", "ops"):
                    for name, (a, b) in tot.get(key, {}).items():
                        cell = acc[key].setdefault(name, [0, 0])
                        cell[0] += a
                        cell[1] += b
    return out
