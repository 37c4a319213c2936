"""Running policies on the reference engine and planning their budgets: the pieces ``treespec demo`` /
``treespec bench`` and the benchmark scripts share (policy presets, timed runs, the table, the exactness
verdict, budget planning from the acceptance table and the measured cost curve)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from ..verify.sampling import is_greedy

__all__ = ["PRESETS", "parse_policies", "label", "PolicyRun", "run_policy", "verdict", "format_table", "failed_requests",
           "draft_dir_of", "plan_vs_measured", "pick_budgets"]

# CPU-sized defaults (a 60-node tree costs about 3.3 decode steps on a 2-core CPU)
PRESETS = {
    "eagle2": {"policy": "eagle2", "budget": 16, "topk": 4, "depth": 4},
    "talon": {"policy": "talon", "budget": 16, "topk": 4, "mu": 0.03},
    "salf": {"policy": "salf", "budget": 16, "batch": 4, "th": 0.6},
    "c2t": {"policy": "c2t", "budget": 16, "topk": 4, "beta": 0.5},
    "chain": {"policy": "chain", "length": 4},
}


def parse_policies(names: str, extra_json: Optional[str] = None, budget: Optional[int] = None) -> List[dict]:
    """``"eagle2,talon"`` -> preset dicts (``budget`` overrides); ``extra_json`` adds full dicts."""
    from ..policies.base import parse_spec

    out = []
    for n in [x.strip() for x in (names or "").split(",") if x.strip()]:
        if n not in PRESETS:
            raise ValueError(f"--policies: unknown policy {n!r}; choose from {sorted(PRESETS)}")
        d = dict(PRESETS[n])
        if budget is not None and "budget" in d:
            d["budget"] = budget
        out.append(d)
    if extra_json:
        try:
            more = json.loads(extra_json)
        except json.JSONDecodeError as e:
            raise ValueError(f"--policy-json is not valid JSON ({e.msg} at char {e.pos}): {extra_json!r}") from None
        more = more if isinstance(more, list) else [more]
        for i, m in enumerate(more):
            if not isinstance(m, dict):
                raise ValueError(f"--policy-json must be a JSON object or a list of objects, item {i} is "
                                 f"{type(m).__name__}: {m!r}")
        out += more
    for i, d in enumerate(out):  # every policy is checked before any model loads
        try:
            parse_spec(d)
        except (ValueError, TypeError) as e:
            raise ValueError(f"policy {i} ({d.get('policy', '?')}): {e}") from None
    if budget is not None and budget < 1:
        raise ValueError(f"--budget must be >= 1, got {budget}")
    return out


def label(spec: Optional[dict]) -> str:
    if spec is None:
        return "plain"
    return spec["policy"] + "(" + ",".join(f"{k}={v}" for k, v in spec.items() if k != "policy") + ")"


@dataclass
class PolicyRun:
    """One policy's timed run. ``seconds``: wall time, prefills included; ``decode_seconds``: the part after
    each batch's prefill (from its first token to its last), what a round plan prices; None where not timed."""

    spec: Optional[dict]
    seconds: float
    results: list = field(default_factory=list)
    decode_seconds: Optional[float] = None

    @property
    def new_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        """Tokens after each request's first (which its prefill emits) per decode second."""
        if not self.decode_seconds:
            return None
        return (self.new_tokens - sum(1 for r in self.results if r.token_ids)) / self.decode_seconds

    def _rounds(self):
        return [a for r in self.results for a in r.stats.accepted]

    @property
    def tau(self) -> float:
        acc = self._rounds()
        return 1.0 + sum(acc) / len(acc) if acc else 1.0

    @property
    def delta(self) -> float:
        n = len(self._rounds())
        return sum(r.stats.draft_forwards for r in self.results) / n if n else 0.0

    @property
    def mean_tree(self) -> float:
        sizes = [s for r in self.results for s in r.stats.tree_sizes]
        return sum(sizes) / len(sizes) if sizes else 1.0


def run_policy(engine, prompts, spec, *, max_new_tokens, batch_size, temperature=0.0, seed=0, bar=None) -> PolicyRun:
    """Generate for all prompts in batches of ``batch_size`` with one policy; wall time measured, and the decode
    part of it: per batch, from the engine's first ``progress`` call (the prefill's token) to the batch's end."""
    results = []
    decode = 0.0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        first = []

        def progress(n):
            if not first:
                first.append(time.perf_counter())
            if bar is not None:
                bar.update(n)

        results += engine.generate(chunk, max_new_tokens=max_new_tokens, policy=spec, temperature=temperature,
                                   seed=seed, progress=progress)
        if first:
            decode += time.perf_counter() - first[0]
    return PolicyRun(spec, time.perf_counter() - t0, results, decode)


def verdict(engine, prompt_ids, base: "PolicyRun", run: "PolicyRun", temperature: float) -> str:
    """The lossless column: float32 outputs must equal plain decoding's; in bf16 every divergence must
    sit at a near-tie of the target's top logits (:mod:`treespec_sglang.engine.exactness`)."""
    errors = [x.error for x in run.results if x.error]
    if errors:  # a failed cell says why (and the command exits non-zero: failed_requests)
        return f"FAILED {len(errors)}/{len(run.results)}: {errors[0]}"
    if run.spec is None:
        return "-"
    if not is_greedy(temperature):
        return "n/a (T>0)"
    ref, outs = [x.token_ids for x in base.results], [x.token_ids for x in run.results]
    if ref == outs:
        return "yes"
    if engine is None or engine.dtype == torch.float32:
        return "NO"
    from .exactness import TIE_BOUND, compare_outputs

    c = compare_outputs(engine, prompt_ids, ref, outs)
    if c["ok"]:
        return f"yes (bf16: {c['diverged']} near-tie, margin {c['max_margin']:.2f} <= {TIE_BOUND})"
    return f"NO (margin {c['max_margin']:.2f} > {TIE_BOUND})"


def format_table(runs: List[PolicyRun], temperature: float, verdicts: Optional[List[str]] = None,
                 peers: Sequence = ()) -> str:
    """One row per run (speedup vs the first, plain) and per peer (``PeerRun``: tok/s, speedup and
    how many outputs equal plain decoding's)."""
    base = runs[0]
    head = f"{'policy':<44} {'tok/s':>7} {'tau':>5} {'delta':>5} {'tree':>5} {'speedup':>7}  lossless"
    lines = [head, "-" * len(head)]
    for i, r in enumerate(runs):
        same = verdicts[i] if verdicts is not None else verdict(None, None, base, r, temperature)
        lines.append(f"{label(r.spec):<44} {r.tokens_per_s:7.2f} {r.tau:5.2f} {r.delta:5.2f} {r.mean_tree:5.1f} "
                     f"{r.tokens_per_s / base.tokens_per_s:6.2f}x  {same}")
    ref = [x.token_ids for x in base.results]
    for p in peers:
        same = sum(a == b for a, b in zip(p.outputs, ref))
        lines.append(f"{'transformers ' + p.name + ', bs 1':<44} {p.tokens_per_s:7.2f} {'':>5} {'':>5} {'':>5} "
                     f"{p.tokens_per_s / base.tokens_per_s:6.2f}x  {same}/{len(ref)} outputs = plain")
    return "\n".join(lines)


def failed_requests(runs: List[PolicyRun]) -> int:
    """How many requests failed across the runs (the commands exit 1 when any did)."""
    return sum(1 for r in runs for x in r.results if x.error)


def draft_dir_of(draft: str) -> Optional[str]:
    """``--draft`` -> the draft directory (``demo`` / ``demo-eagle3``: the shipped heads; ``random``: none)."""
    if draft in ("demo", "demo-eagle3"):
        from .loading import demo_draft_dir, eagle3_draft_dir

        return demo_draft_dir() if draft == "demo" else eagle3_draft_dir()
    return None if draft == "random" else draft


def plan_vs_measured(runs: List["PolicyRun"], plans: dict) -> List[str]:
    """Per planned policy: planned tau and speedup next to the measured ones (``plans``: policy ->
    ``BudgetChoice`` from :func:`pick_budgets`), and a plain sentence when no policy was expected to,
    or did, beat plain decoding. ``runs[0]`` is plain decoding. A plan prices decode rounds, so its speedup
    stands next to the decode rounds' measured one; the end-to-end one also pays each batch's prefill, the same
    for every policy, which pulls it towards 1x (at bs 8 on a 2-core CPU a prefill is about a quarter of a
    64-token plain run)."""
    if not plans:
        return []
    lines = ["| policy | planned tau | measured tau | tau error | planned speedup | measured: decode rounds | "
             "end to end |", "|---|---|---|---|---|---|---|"]
    plain, plain_decode = runs[0].tokens_per_s, runs[0].decode_tokens_per_s
    for r in runs[1:]:
        c = plans.get(r.spec["policy"]) if r.spec else None
        if c is None:
            continue
        err = (r.tau - c.tau) / c.tau
        dec = r.decode_tokens_per_s
        dec = f"{dec / plain_decode:.2f}x" if dec is not None and plain_decode else "-"
        lines.append(f"| {label(r.spec)} | {c.tau:.2f} | {r.tau:.2f} | {err:+.0%} | {c.speedup:.2f}x | {dec} | "
                     f"{r.tokens_per_s / plain:.2f}x |" if plain else "| - |")
    best_plan = max(plans.values(), key=lambda c: c.speedup)
    if best_plan.speedup <= 1.0:
        lines.append(f"no policy was expected to beat plain decoding on this machine (best plan: {best_plan.policy} "
                     f"at {best_plan.speedup:.2f}x): verifying a tree costs more here than its accepted tokens save")
    if plain and all(r.tokens_per_s <= plain for r in runs[1:]):
        lines.append("no policy beat plain decoding in this run")
    return lines


def pick_budgets(engine, specs, draft_dir, budget_flag, bs: int = 1, plans: Optional[dict] = None,
                 overheads: bool = True):
    """Replace each preset's budget by the one this machine's cost curve favours -> (specs, lines).
    ``plans`` (a dict) receives each planned policy's ``BudgetChoice``. The cost curve is measured at batch
    ``bs`` (a bs-4 plan prices a bs-4 forward). ``overheads``: price each round with its measured overhead too
    (:mod:`~treespec_sglang.engine.overhead`: a few real rounds per policy at the batch and at the budget the
    curve alone picks, then the choice is made again). At ``bs`` > 1 with overheads, the batch's tail is priced
    as well where the acceptance table holds per-prompt taus (:mod:`~treespec_sglang.engine.batch_tail`): the
    bs-1 curve and bs-1 overheads price a round of one row."""
    from .cost import BatchTail, choose_budgets, load_policy_table
    from .overhead import measure_overheads

    table = load_policy_table(draft_dir)
    if budget_flag is not None or table is None:
        why = "--budget" if budget_flag is not None else f"no policy_table.json beside the draft ({draft_dir})"
        return specs, [f"budgets: the presets' ({why})"]
    curve, cached = engine.measured_cost_curve(bs)
    rows = {s["policy"]: table[s["policy"]] for s in specs if s and s["policy"] in table}
    picks = choose_budgets(rows, curve, bs=bs)
    lines = [f"cost curve ({'cached' if cached else 'measured now'}, {engine.dtype}, batch {curve.bs}): verify "
             + ", ".join(f"{n} tok {ms:.1f} ms" for n, ms in zip(curve.sizes, curve.verify_ms) if n in (1, 4, 8, 16, 32))
             + f"; draft step {curve.draft_ms[0]:.1f} ms"]
    curve_only = None  # the curve-alone picks, kept where overheads are measured (printed beside the plan)
    if overheads and picks:
        at = {p: rows[p][str(c.budget)] for p, c in picks.items()}
        measure = [dict(r["spec"]) for r in at.values()]
        widths = {p: r.get("width", 1.0) for p, r in at.items()}
        ov = measure_overheads(engine, curve, measure, widths, bs=bs)
        lines.append(ov.lines())
        tail = None
        if bs > 1:
            if any(r.get("taus") for pol in rows.values() for r in pol.values()):
                curve1 = engine.measured_cost_curve(1)[0]
                ov1 = measure_overheads(engine, curve1, measure, widths, bs=1)
                tail = BatchTail(curve1, ov1)
                lines.append(ov1.lines() + " (prices the batch's tail: its last rounds run fewer rows)")
            else:
                lines.append("the batch's tail is not priced: the acceptance table holds no per-prompt taus "
                             "(bench/policy_table.py writes them)")
        curve_only, picks = picks, choose_budgets(rows, curve, bs=bs, overheads=ov, tail=tail)
    out = []
    for s in specs:
        c = picks.get(s["policy"]) if s else None
        if c is None:
            out.append(s)
            continue
        out.append(dict(table[s["policy"]][str(c.budget)]["spec"]))
        if plans is not None:
            plans[s["policy"]] = c
        alone = curve_only[s["policy"]] if curve_only else None
        was = f"; the curve alone: budget {alone.budget}, {alone.speedup:.2f}x" if alone else ""
        tail_note = f", batch tail x{c.tail:.2f}" if c.tail != 1.0 else ""
        lines.append(f"  {s['policy']:<7} budget {c.budget:<3} (acceptance table tau {c.tau:.2f}, "
                     f"{c.round_ms:.1f} ms/round{tail_note} -> expected {c.speedup:.2f}x{was})")
    return out, [f"budgets: per policy, the best expected tokens/s at batch {bs} on this machine's cost curve"] + lines
