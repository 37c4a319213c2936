"""One row per cell from its request records; the markdown table; the plots.

Definitions (per cell, over its successful requests):

- ``output_tok_s`` = Σ completion tokens / cell wall time; ``req_s`` = requests / wall time.
- ``accept_length`` = Σ completion tokens / Σ verify rounds (SGLang's ``spec_accept_length``; 1 when plain).
- ``tau`` = 1 + mean accepted drafts per round: from ``treespec_accept_lengths`` for policy requests, from
  SGLang's ``spec_num_correct_drafts / spec_verify_ct`` for native ones (the prefill token is not a round,
  so tau <= accept_length).
- ``verified_per_round`` = tokens the target's verify forward ran per request per round
  (``treespec_verify_tokens``; N for native requests, which always verify N; 1 for plain decoding).
- ``ttft_ms_p*`` / ``itl_ms_p*``: percentiles of time to first token and of the gaps between token-bearing
  stream chunks (with speculation a chunk is a round: several tokens); ``tpot_ms`` = (latency - TTFT) /
  (tokens - 1), mean. The server's prefix cache is flushed before each cell, so TTFT includes prefill.
- ``same_output`` (T = 0 only): fraction of prompts whose output ids equal the plain server's (or, without
  a plain server in the run, native EAGLE's) at T = 0.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Dict, List, Optional, Sequence

import numpy as np

from .client import RequestRecord
from .matrix import Cell

__all__ = ["summarize", "percentiles", "mark_same_output", "format_table", "plot"]


def percentiles(xs: Sequence[float], name: str, scale: float = 1000.0) -> Dict[str, Optional[float]]:
    """``{name_p50, name_p90, name_p99}`` (linear interpolation, times ``scale``); None when empty."""
    arr = np.asarray(list(xs), dtype=np.float64)
    return {f"{name}_p{q}": (float(np.percentile(arr, q)) * scale if arr.size else None) for q in (50, 90, 99)}


def summarize(cell: Cell, records: List[RequestRecord], wall: float) -> dict:
    ok = [r for r in records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    rounds = sum(int(r.meta.get("spec_verify_ct") or 0) for r in ok)
    accepts = [a for r in ok for a in (r.meta.get("treespec_accept_lengths") or [])]
    verify = [v for r in ok for v in (r.meta.get("treespec_verify_tokens") or [])]
    sizes = [s for r in ok for s in (r.meta.get("treespec_tree_sizes") or [])]
    speculative = cell.server.algorithm != "none"
    if accepts:
        tau = 1.0 + float(np.mean(accepts))
    elif speculative and rounds:
        tau = 1.0 + sum(int(r.meta.get("spec_num_correct_drafts") or 0) for r in ok) / rounds
    else:
        tau = 1.0
    if not speculative:
        verified = 1.0
    elif verify:
        verified = float(np.mean(verify))
    else:
        verified = float(cell.server.n)
    tpot = [(r.latency - r.ttft) / (r.completion_tokens - 1) for r in ok
            if r.latency is not None and r.ttft is not None and r.completion_tokens > 1]
    errors = [r.error for r in records if not r.ok]
    hist = Counter(accepts)  # accepted drafts per round -> rounds
    row = dict(cell=cell.label, server=cell.server.label, algorithm=cell.server.algorithm, topk=cell.server.topk,
               steps=cell.server.steps, N=cell.server.n, policy=cell.policy_label, spec=cell.spec,
               budget=cell.budget, concurrency=cell.concurrency, temperature=cell.temperature,
               requests=len(records), ok=len(ok), errors=len(errors), error_examples=sorted(set(errors))[:3],
               wall_s=wall, output_tokens=tokens, output_tok_s=tokens / wall if wall > 0 else 0.0,
               req_s=len(ok) / wall if wall > 0 else 0.0,
               accept_length=(tokens / rounds if rounds else 1.0) if speculative else 1.0, tau=tau,
               rounds=rounds if speculative else tokens, verified_per_round=verified,
               mean_tree_size=float(np.mean(sizes)) if sizes else (float(cell.server.n) if speculative else 1.0),
               accept_hist=[hist[k] for k in sorted(hist)], accept_hist_values=sorted(hist),
               tpot_ms=float(np.mean(tpot)) * 1000 if tpot else None, same_output=None)
    row.update(percentiles([r.ttft for r in ok if r.ttft is not None], "ttft_ms"))
    row.update(percentiles([g for r in ok for g in r.itl], "itl_ms"))
    return row


def mark_same_output(rows: List[dict], outputs: Dict[str, List[Optional[List[int]]]]) -> None:
    """Fill ``same_output`` of every T = 0 row against the reference (plain, else native) T = 0 outputs."""
    greedy = [r for r in rows if r["temperature"] == 0.0]
    ref = next((r for r in greedy if r["policy"] == "plain"), None) or next(
        (r for r in greedy if r["policy"] == "native"), None)
    if ref is None:
        return
    want = outputs[ref["cell"]]
    for r in greedy:
        got = outputs[r["cell"]]
        pairs = [(a, b) for a, b in zip(got, want) if a is not None and b is not None]
        r["same_output"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
        r["same_output_reference"] = ref["cell"]


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def format_table(rows: List[dict]) -> str:
    head = ("| server | policy | conc | T | tok/s | req/s | accept len | tau | verified/round | TTFT p50 ms | "
            "ITL p50 ms | ITL p99 ms | same output | errors |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['server']} | {r['policy']} | {r['concurrency']} | {r['temperature']:g} | "
                     f"{r['output_tok_s']:.1f} | {r['req_s']:.2f} | {r['accept_length']:.2f} | {r['tau']:.2f} | "
                     f"{r['verified_per_round']:.1f} | {_f(r['ttft_ms_p50'], '{:.0f}')} | "
                     f"{_f(r['itl_ms_p50'], '{:.0f}')} | {_f(r['itl_ms_p99'], '{:.0f}')} | "
                     f"{_f(r['same_output'], '{:.0%}')} | {r['errors']} |")
    return "\n".join(lines)


def plot(rows: List[dict], out: str) -> List[str]:
    """``policies_vs_concurrency.png`` (tau and tok/s per policy vs concurrency, one line per server+policy+T)
    and ``accept_hist.png`` (accepted drafts per round, policy rows). Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lines: Dict[str, List[dict]] = {}
    for r in rows:
        lines.setdefault(f"{r['server']} {r['policy']} T{r['temperature']:g}", []).append(r)
    for name, rs in lines.items():
        rs = sorted(rs, key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        axes[0].plot(xs, [r["tau"] for r in rs], marker="o", label=name)
        axes[1].plot(xs, [r["output_tok_s"] for r in rs], marker="o", label=name)
    for ax, what in zip(axes, ("tau (1 + accepted drafts per round)", "output tokens / s")):
        ax.set_xlabel("concurrency")
        ax.set_ylabel(what)
        ax.set_xscale("log", base=2)
    axes[1].legend(fontsize=6, loc="best")
    fig.suptitle("per-request tree policies inside SGLang, same run")
    fig.tight_layout()
    paths.append(os.path.join(out, "policies_vs_concurrency.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    hist: Dict[str, Counter] = {}  # one bar group per server + policy + T, summed over concurrency
    for r in rows:
        if r["accept_hist"]:
            c = hist.setdefault(f"{r['server']} {r['policy']} T{r['temperature']:g}", Counter())
            c.update(dict(zip(r["accept_hist_values"], r["accept_hist"])))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / max(1, len(hist))
    for i, (name, c) in enumerate(hist.items()):
        xs = np.asarray(sorted(c))
        ax.bar(xs + i * width - 0.4 + width / 2, np.asarray([c[x] for x in xs]) / sum(c.values()), width=width,
               label=name)
    if hist:
        ax.set_xticks(range(0, max(max(c) for c in hist.values()) + 1))
    ax.set_xlabel("accepted draft tokens per round")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("accept-length histogram (policy requests; native rows report totals only)")
    if hist:
        ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(os.path.join(out, "accept_hist.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
