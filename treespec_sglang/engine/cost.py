"""The machine's cost curve and per-policy budgets chosen from it.

:func:`measure_cost_curve` times, on the engine as loaded (dtype, threads), one verify forward of
``n`` tree tokens over a ``prefix``-token cache plus the target LM head on those rows, and one draft
step at width ``w`` (draft layer + its LM head + log_softmax). It takes a few seconds and is cached
on disk per machine / torch / dtype / model / threads.

:func:`choose_budgets` combines that curve with a draft's *acceptance table* (tau and draft
forwards per round for each policy at each budget, measured once offline on validation prompts
by ``bench/policy_table.py`` and shipped beside the draft as ``policy_table.json``) and picks, per
policy, the budget with the highest expected tokens/s::

    tokens/s(N) = tau(N) / (verify_ms(tree(N)) + delta(N) * draft_ms(width) + overhead_ms)

Acceptance is a property of the draft and the policy; cost is a property of the machine: that
split is what lets one shipped table serve every machine. A curve is measured at one batch size ``bs``
(every forward runs ``bs`` requests, each with its own ``prefix``-token cache and ``n`` tree tokens), so a
plan for a batch of 4 prices a round by what a batch-4 round's forwards cost, attention over 4 caches
included, not by a batch-1 forward over 4 times the tokens. A batch plan can also price its tail, the last
rounds after the fastest requests are done (:class:`BatchTail`, :mod:`treespec_sglang.engine.batch_tail`). The
online fit of a running call's rounds is :mod:`treespec_sglang.engine.round_cost`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from .kv_cache import KVCache

__all__ = ["CostCurve", "measure_cost_curve", "choose_budgets", "BudgetChoice", "BatchTail", "load_policy_table",
           "POLICY_TABLE"]

POLICY_TABLE = "policy_table.json"


PREFIX = 256  # tokens of context each request's timed forwards attend to (measure_cost_curve's default)


@dataclass(frozen=True)
class CostCurve:
    """Measured milliseconds of one forward of a batch of ``bs`` requests: ``verify_ms[i]`` for ``sizes[i]``
    tree tokens per request, ``draft_ms[j]`` for one draft step at ``widths[j]`` frontier nodes per request."""

    sizes: Tuple[int, ...]
    verify_ms: Tuple[float, ...]
    widths: Tuple[int, ...]
    draft_ms: Tuple[float, ...]
    bs: int = 1

    def __post_init__(self):
        for xs, ys, name in ((self.sizes, self.verify_ms, "sizes"), (self.widths, self.draft_ms, "widths")):
            if len(xs) < 1 or len(xs) != len(ys) or list(xs) != sorted(set(xs)) or xs[0] < 1:
                raise ValueError(f"CostCurve.{name} must be increasing positive integers, one time each")
        if isinstance(self.bs, bool) or not isinstance(self.bs, int) or self.bs < 1:
            raise ValueError(f"CostCurve.bs must be an integer >= 1, got {self.bs!r}")

    @staticmethod
    def _interp(xs, ys, x: float) -> float:
        if x <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return ys[-1] + (ys[-1] - ys[-2]) * (x - xs[-1]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1]

    def scale(self, bs: int, use: str) -> int:
        """Tokens of one forward per token of this curve when pricing batch ``bs``: ``bs`` on a bs-1 curve
        (``bs`` times the tokens in one sequence), 1 on a curve measured at ``bs``; any other curve raises,
        naming ``use`` (what it was asked for). Example: a bs-1 curve at bs 4 -> 4; a bs-4 curve -> 1."""
        if self.bs not in (1, bs):
            raise ValueError(f"a cost curve measured at batch {self.bs} cannot {use}: measure it at {bs} or 1")
        return bs // self.bs

    def verify(self, n: float) -> float:
        """Interpolated (linearly extrapolated past the last size) ms for ``n`` verified tokens."""
        return self._interp(self.sizes, self.verify_ms, n)

    def draft(self, w: float) -> float:
        return self._interp(self.widths, self.draft_ms, w)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, oneDNN primitive cache)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def _positions(start: int, n: int, bs: int, dev) -> torch.Tensor:
    # -> [bs, n] int64: every request's positions start .. start + n - 1
    return (start + torch.arange(n, device=dev))[None].expand(bs, n)


@torch.inference_mode()
def _measure(engine, sizes, widths, prefix: int, repeats: int, bs: int = 1) -> CostCurve:
    # bs requests, each with its own random prefix-token cache; every timed forward runs all of them
    tcfg, dcfg, dev = engine.target.config, engine.draft.config, engine.device
    top = max(sizes)
    cache = KVCache(tcfg.num_hidden_layers, bs, tcfg.num_key_value_heads, prefix + top, tcfg.head_dim, engine.dtype, dev)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tcfg.vocab_size, (bs, prefix + top), generator=g).to(dev)  # [bs, prefix + top]
    pos = _positions(0, prefix, bs, dev)  # [bs, prefix]
    engine.target(ids[:, :prefix], pos, cache.stores(pos, prefix),
                  torch.ones(prefix, prefix, dtype=torch.bool, device=dev).tril()[None].expand(bs, -1, -1))

    def verify(n):
        p = _positions(prefix, n, bs, dev)  # [bs, n]
        mask = torch.ones(n, prefix + n, dtype=torch.bool, device=dev).tril(prefix)[None].expand(bs, -1, -1)
        return lambda: engine.calls.logits(engine.target(ids[:, prefix:prefix + n], p, cache.stores(p, prefix + n), mask))

    dcache = KVCache(1, bs, dcfg.num_key_value_heads, prefix + 1 + max(widths), dcfg.head_dim, engine.dtype, dev)

    def draft(w):
        p = _positions(prefix, w, bs, dev)  # [bs, w]
        mask = torch.ones(w, prefix + w, dtype=torch.bool, device=dev)[None].expand(bs, -1, -1)
        feats = torch.zeros(bs, w, dcfg.hidden_size, dtype=engine.dtype, device=dev)
        return lambda: engine.calls.draft_logprobs(engine.draft(ids[:, :w], feats, p, dcache.stores(p, prefix + w)[0], mask))

    return CostCurve(tuple(sizes), tuple(_median_ms(verify(n), repeats) for n in sizes),
                     tuple(widths), tuple(_median_ms(draft(w), repeats) for w in widths), bs)


def _cpu_name(path: str = "/proc/cpuinfo") -> str:
    """The CPU as the cost curve's cache key and the benchmarks' figures name it: the model name with its family,
    model and stepping where the system reports them (a VM may report only "AMD EPYC" for Zen 3, 4 and 5 alike,
    whose cost curves differ), e.g. ``"AMD EPYC (family 25 model 1 stepping 1)"``; else ``platform.processor()``."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block only
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor()
    ids = [f"{k} {fields[f]}" for f, k in (("cpu family", "family"), ("model", "model"), ("stepping", "stepping"))
           if fields.get(f)]
    return f"{name} ({' '.join(ids)})" if ids else name


def measure_cost_curve(engine, sizes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
                       widths: Sequence[int] = (1, 2, 4, 8, 16), prefix: int = PREFIX, repeats: int = 5,
                       cache_dir: Optional[str] = None, model_id: str = "", bs: int = 1) -> Tuple[CostCurve, bool]:
    """-> (curve, whether it came from the cache). ``cache_dir`` None: measure, store nothing. ``bs``: the
    batch size every timed forward runs (module docstring)."""
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(f"bs must be an integer >= 1, got {bs!r}")
    key = json.dumps([_cpu_name(), torch.__version__, str(engine.dtype), str(engine.device), torch.get_num_threads(),
                      getattr(engine, "packed", False),
                      model_id, engine.target.config.hidden_size, engine.target.config.num_hidden_layers,
                      engine.draft_vocab, type(engine.draft).__name__, list(sizes), list(widths), prefix]
                     + ([bs] if bs > 1 else []))  # bs 1 keeps the key (and the cache files) it had
    path = None
    if cache_dir is not None:
        path = os.path.join(cache_dir, f"cost-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json")
        if os.path.isfile(path):
            with open(path) as f:
                d = json.load(f)
            return CostCurve(**{k: tuple(v) for k, v in d["curve"].items()}, bs=d.get("bs", 1)), True
    curve = _measure(engine, sizes, widths, prefix, repeats, bs)
    if path is not None:
        with open(path + ".tmp", "w") as f:
            json.dump({"key": key, "bs": bs, "curve": {k: list(getattr(curve, k)) for k in
                                                      ("sizes", "verify_ms", "widths", "draft_ms")}}, f)
        os.replace(path + ".tmp", path)
    return curve, False


def load_policy_table(draft_dir: Optional[str]) -> Optional[dict]:
    """``{policy: {budget: {"tau", "delta", "tree", "width"}}}`` from ``<draft_dir>/policy_table.json``."""
    if not draft_dir:
        return None
    path = os.path.join(draft_dir, POLICY_TABLE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)["table"]


@dataclass(frozen=True)
class BudgetChoice:
    policy: str
    budget: int
    tau: float
    round_ms: float
    speedup: float  # expected tokens/s over plain decoding on this curve
    tail: float = 1.0  # the batch tail's price over the untailed one (1: not priced, or no tail)


@dataclass(frozen=True)
class BatchTail:
    """How a batch plan prices its tail (:mod:`~treespec_sglang.engine.batch_tail`): a round of one row, priced
    on a bs-1 ``curve`` plus ``overheads`` measured at bs 1 (an ``Overheads``, or None for none)."""

    curve: CostCurve
    overheads: object = None

    def __post_init__(self):
        if self.curve.bs != 1:
            raise ValueError(f"BatchTail.curve must be measured at batch 1, got batch {self.curve.bs}")


def _forwards_ms(curve: CostCurve, k: int, r: dict) -> float:
    """A round's forwards for one acceptance-table row at ``k`` curve tokens per request token."""
    return curve.verify(k * r["tree"]) + r["delta"] * curve.draft(k * r.get("width", 1))


def _extra_ms(overhead_ms: float, overheads, policy: str) -> float:
    return overhead_ms + (overheads.round_ms.get(policy, 0.0) if overheads is not None else 0.0)


def choose_budgets(table: Dict[str, Dict[str, dict]], curve: CostCurve, overhead_ms: float = 0.0,
                   bs: int = 1, overheads=None, tail: Optional[BatchTail] = None) -> Dict[str, BudgetChoice]:
    """Per policy, the budget with the highest expected tokens/s (module docstring's formula).

    ``bs``: the batch the plan is for. A curve measured at that batch (``curve.bs == bs``) prices a round
    directly: ``verify_ms(tree)`` per request's tree, draft steps at the per-request width, a plain step
    ``verify_ms(1)``. A bs-1 curve approximates a batch's round by ``bs`` times the tokens in one sequence
    (one forward verifies every request's tree; the draft steps run at ``bs`` times the width), which
    leaves out the attention over ``bs`` caches. Either way the best budget shrinks as the batch grows on a
    compute-bound CPU. Any other curve is refused.

    ``table[policy][str(budget)]`` holds ``tau`` (tokens per round), ``delta`` (draft forwards per
    round), ``tree`` (mean verified tokens per round) and ``width`` (mean frontier per draft step), and may
    hold ``taus`` (each validation prompt's own tau).

    ``overhead_ms`` is added to a plain step and to every round alike; ``overheads``
    (:class:`~treespec_sglang.engine.overhead.Overheads`, measured by running real rounds) adds its own
    per-step and per-policy round times on top, the part of a round the curve's forwards do not price.

    ``tail`` (bs > 1, rows with ``taus``): the batch runs until its slowest request is done, its last rounds
    over fewer rows. A row is then priced by :func:`~treespec_sglang.engine.batch_tail.batch_ms_per_token`
    between a round of one row (``tail``'s bs-1 curve and overheads) and the round of ``bs`` rows above,
    instead of that round over the mean tau; ``BudgetChoice.tail`` is the ratio of the two prices.

    Example: with verify 40 ms at 1 token and 48 ms at 8, draft 2 ms, tau(4) = 2.0 with delta 2 and
    tau(8) = 2.4 with delta 3, budget 8 wins: 2.4 / (48 + 6) > 2.0 / (44 + 4).
    """
    from .batch_tail import batch_ms_per_token

    if bs < 1:
        raise ValueError(f"bs must be >= 1, got {bs}")
    k = curve.scale(bs, f"plan batch {bs}")
    plain = curve.verify(k) + overhead_ms + (overheads.step_ms if overheads is not None else 0.0)
    out = {}
    for policy, rows in table.items():
        best = None
        extra = _extra_ms(overhead_ms, overheads, policy)
        for budget, r in rows.items():
            ms = _forwards_ms(curve, k, r) + extra
            per_token, ratio = ms / r["tau"], 1.0
            if tail is not None and bs > 1 and r.get("taus"):
                c1 = _forwards_ms(tail.curve, 1, r) + _extra_ms(overhead_ms, tail.overheads, policy)
                per_token = batch_ms_per_token(r["taus"], bs, c1, ms)
                ratio = per_token * r["tau"] / ms
            c = BudgetChoice(policy, int(budget), r["tau"], ms, plain / per_token, ratio)
            if best is None or c.speedup > best.speedup:
                best = c
        if best is not None:
            out[policy] = best
    return out
