"""The reference engine: one token cap for the whole batch vs the best fixed tree size per request.

Same engine, same prompts, one run: the held-out split (every 10th prompt of HumanEval, MT-bench, GSM8K
and the stdlib stubs, the sets the shipped draft was trained on the other 90% of), interleaved so every
batch mixes code, chat and math; greedy; bf16 on this CPU unless ``--dtype``. For each batch size:

- ``fixed N``: every request verifies an EAGLE-2 tree of N nodes (depth = the preset for N); the sweep
  over ``--sizes`` finds the best fixed N (tok/s).
- ``batch T=bs*N``: every request's policy proposes ``--cap-factor`` x N candidates (one level deeper
  than the fixed-N tree)
  and the batch keeps its ``bs * N`` best nodes: the *equal verified tokens* comparison
  (accepted draft tokens per verified token).
- ``auto``: T per round from the machine's verify-cost curve (slope) and the rounds' measured time
  (level), over ``--auto-cap`` candidates per request at ``--auto-depth``, drafting only the nodes worth
  their verify (``draft_prune``, the engine's default); ``auto+cal`` also weighs the path probabilities
  by the per-depth correction learned online, whose calibration curve is printed at the end.

Two throughputs: *full-batch* tok/s counts the rounds while every request of a batch is still running
(what a continuously batched server sees: a finished request is replaced at once) and *static-batch*
tok/s the whole ``generate`` call (whose wall time is its slowest request's, so moving verified tokens to the
confident requests finishes them early and leaves the batch waiting on the slowest).

Lossless: greedy output vs plain greedy, with the bf16 near-tie verdict of ``treespec demo``.

    python bench/token_cap.py --bs 1,8,32 --sizes 2,4,6,8 --max-new-tokens 48 --out bench/results/token_cap.json
"""

import argparse
import json
import statistics
import time


def heldout_prompts(per_set):
    from treespec_sglang.data.prompts import gsm8k, humaneval, mtbench, pycode

    sets = [humaneval().every(10), mtbench().every(10), gsm8k().take(500).every(10), pycode(500).every(10)]
    cols = [s.take(per_set).prompts for s in sets]
    return [p for group in zip(*cols) for p in group]  # code, chat, math, code, ...


def full_phase(res, times):
    """(tokens, seconds) of one batch's rounds while every request was still running: what a server with
    continuous batching sees (a finished request is replaced at once), free of this static batch's
    straggler (the batch's wall time is its slowest request's). ``times[k]`` = after verify round k."""
    r_min = min(len(r.stats.accepted) for r in res)  # the first request to finish ends the full phase
    k = r_min - 1  # its last round may be cut by max_new_tokens / EOS: excluded
    if k < 1:
        return 0, 0.0
    return sum(sum(r.stats.accepted[:k]) + k for r in res), times[k] - times[0]


def run(engine, prompts, spec, bs, max_new, token_cap=None, calibrate=False):
    t0 = time.perf_counter()
    res, full_tok, full_s, curve = [], 0, 0.0, None
    for i in range(0, len(prompts), bs):
        times = []
        part = engine.generate(prompts[i:i + bs], max_new_tokens=max_new, policy=spec, token_cap=token_cap,
                               calibrate=calibrate, progress=lambda _n: times.append(time.perf_counter()))
        if calibrate:  # the curve of every call of the run, not just the last one's
            cal = engine.calibration
            sums = [cal.curve_n, cal.curve_pred, cal.curve_corr, cal.curve_hit]
            curve = sums if curve is None else [a + b for a, b in zip(curve, sums)]
        if spec is not None:
            tok, sec = full_phase(part, times)
            full_tok, full_s = full_tok + tok, full_s + sec
        else:  # plain: every round commits one token per running request
            k = min(len(r.token_ids) for r in part) - 1
            full_tok, full_s = full_tok + k * len(part), full_s + (times[k] - times[0] if k >= 1 else 0.0)
        res += part
    dt = time.perf_counter() - t0
    acc = sum(sum(r.stats.accepted) for r in res)
    verified = sum(sum(r.stats.tree_sizes) for r in res)
    rounds = sum(len(r.stats.accepted) for r in res)
    toks = sum(len(r.token_ids) for r in res)
    return dict(accepted_per_verified=acc / verified if verified else 0.0, tau=1 + acc / rounds if rounds else 1.0,
                verified_per_round=verified / rounds if rounds else 0.0, tok_s=toks / dt, seconds=dt,
                full_tok_s=full_tok / full_s if full_s else 0.0, curve=_curve(curve),
                outputs=[r.token_ids for r in res])


def depth_of(n):
    """EAGLE-2 depth for a fixed N: N // 2 (N=2 -> depth 1, the root's best child: a second draft step
    could never beat its own parent, so drafting it would only cost time)."""
    return max(1, min(8, n // 2))


def _curve(sums):
    """Calibration curve per bin from summed [nodes, raw prediction, corrected prediction, accepted]."""
    if sums is None:
        return None
    n, pred, corr, hit = sums
    d = n.clamp(min=1)
    return {"bin_lo": [i / n.numel() for i in range(n.numel())], "nodes": n.tolist(), "predicted": (pred / d).tolist(),
            "corrected": (corr / d).tolist(), "accepted": (hit / d).tolist()}


def eagle2(n, depth=None, topk=4):
    return {"policy": "eagle2", "budget": n, "topk": topk, "depth": depth_of(n) if depth is None else depth}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", default="1,8,32")
    ap.add_argument("--sizes", default="2,4,6,8")
    ap.add_argument("--cap-factor", type=int, default=2)
    ap.add_argument("--auto-cap", type=int, default=8, help="candidates per request for the auto rows")
    ap.add_argument("--auto-depth", type=int, default=3, help="their EAGLE-2 depth (draft steps per round)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--per-set", type=int, default=8, help="held-out prompts per set (4 sets)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from treespec_sglang.engine.runs import PolicyRun, verdict
    from treespec_sglang.engine import SpecEngine

    torch.set_num_threads(2)
    engine = SpecEngine.from_pretrained("smollm2-135m", draft="demo", dtype=a.dtype)
    prompts = heldout_prompts(a.per_set)
    ids = engine.encode(prompts)
    engine.generate(prompts[:1], max_new_tokens=2, policy=eagle2(4))
    engine.measured_cost_curve()  # measured (or read) before anything is timed
    report = {"dtype": str(engine.dtype), "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "batches": []}
    for bs in [int(x) for x in a.bs.split(",")]:
        plain = run(engine, prompts, None, bs, a.max_new_tokens)
        base = PolicyRun(None, plain["seconds"], [_Res(o) for o in plain["outputs"]])
        configs = []
        for n in [int(x) for x in a.sizes.split(",")]:
            configs.append((f"fixed N={n}", n, eagle2(n), None, False))
            configs.append((f"batch T=bs*{n}", n, eagle2(a.cap_factor * n, depth_of(n) + 1), bs * n, False))
        configs.append(("auto", None, eagle2(a.auto_cap, a.auto_depth), "auto", False))
        configs.append(("auto+cal", None, eagle2(a.auto_cap, a.auto_depth), "auto", True))
        # this machine's timings drift by +-25% from run to run: every config runs --repeats times,
        # interleaved (plain included), and the median of each throughput is reported
        reps = {c[0]: [] for c in configs}
        plains = [plain]
        for rep in range(a.repeats):
            if rep:
                plains.append(run(engine, prompts, None, bs, a.max_new_tokens))
            for mode, n, spec, token_cap, cal in configs:
                r = run(engine, prompts, spec, bs, a.max_new_tokens, token_cap, cal)
                if cal:
                    r["calibration"] = r.pop("curve")
                    r["depth_ratios"] = [round(x, 3) for x in engine.calibration.ratios().tolist()[:8]]
                reps[mode].append(r)
        for key in ("full_tok_s", "tok_s"):
            plain[key] = statistics.median(p[key] for p in plains)
        rows = []

        def add(mode, n, spec, token_cap=None, cal=False):
            r = dict(reps[mode][0])
            for key in ("full_tok_s", "tok_s"):
                r[key + "_runs"] = [x[key] for x in reps[mode]]
                r[key] = statistics.median(r[key + "_runs"])
            r["lossless"] = verdict(engine, ids, base, PolicyRun(spec, r["seconds"], [_Res(o) for o in r["outputs"]]),
                                    0.0)
            r.update(mode=mode, n=n, spec=spec, token_cap=token_cap, calibrate=cal)
            r.pop("outputs")
            r.pop("curve", None)
            rows.append(r)
            print(f"| {bs} | {mode} | {r['accepted_per_verified']:.3f} | {r['tau']:.2f} | {r['verified_per_round']:.1f}"
                  f" | {r['full_tok_s']:.1f} | {r['full_tok_s'] / plain['full_tok_s']:.2f}x | {r['tok_s']:.1f} | "
                  f"{r['lossless']} |", flush=True)

        print(f"\nbs {bs}: {len(prompts)} held-out prompts, {a.max_new_tokens} new tokens, plain "
              f"{plain['full_tok_s']:.1f} tok/s full-batch, {plain['tok_s']:.1f} static")
        print("| bs | mode | accepted / verified | tau | verified / request / round | full-batch tok/s | vs plain "
              "| static-batch tok/s | lossless |")
        print("|---|---|---|---|---|---|---|---|---|")
        for c in configs:
            add(*c)
        fixed = [r for r in rows if r["mode"].startswith("fixed")]
        best = max(fixed, key=lambda r: r["full_tok_s"])
        auto = max((r for r in rows if r["mode"].startswith("auto")), key=lambda r: r["full_tok_s"])
        eq = {r["n"]: r for r in rows if r["mode"].startswith("batch")}
        gains = {n: eq[n]["accepted_per_verified"] / f["accepted_per_verified"] - 1 for f in fixed for n in [f["n"]]
                 if f["accepted_per_verified"] > 0}
        print(f"full-batch: best fixed N={best['n']} {best['full_tok_s']:.1f} tok/s; best auto ({auto['mode']}) "
              f"{auto['full_tok_s']:.1f} tok/s = {auto['full_tok_s'] / best['full_tok_s'] - 1:+.1%}; accepted/verified "
              f"at equal T: "
              + ", ".join(f"N={n} {g:+.1%}" for n, g in gains.items()))
        report["batches"].append(dict(bs=bs, plain_tok_s=plain["tok_s"], rows=rows, best_fixed_n=best["n"],
                                      auto_vs_best_fixed=auto["full_tok_s"] / best["full_tok_s"] - 1,
                                      auto_vs_best_fixed_static=auto["tok_s"] / max(r["tok_s"] for r in fixed) - 1,
                                      equal_t_gain=gains))
        cal = next(r for r in rows if r["mode"] == "auto+cal")["calibration"]
        print("calibration (auto+cal): bin | nodes | draft path prob | corrected | accepted")
        for i, lo in enumerate(cal["bin_lo"]):
            if cal["nodes"][i]:
                print(f"  [{lo:.1f}, {lo + 0.1:.1f}) | {int(cal['nodes'][i])} | {cal['predicted'][i]:.3f} | "
                      f"{cal['corrected'][i]:.3f} | {cal['accepted'][i]:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)


class _Res:  # the slice of GenerationResult that verdict() reads
    def __init__(self, token_ids):
        self.token_ids, self.error = token_ids, None


if __name__ == "__main__":
    main()
