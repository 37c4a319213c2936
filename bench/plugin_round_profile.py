"""A treespec round against a native round on one SGLang engine: where every extra millisecond goes.

One engine (the demo target + the shipped EAGLE draft, topk 4 / steps 3 / N 8 by default) serves the held-out
prompts once per policy set and concurrency, greedy: native EAGLE, each policy alone, and every policy mixed with
native requests; per set tokens per second (completion tokens over the wall time, ``--plain``: beside a plain
engine's) and tau (1 + SGLang's accepted drafts per verify round). The plugin's round profiler (``TREESPEC_PROFILE``, :mod:`treespec_sglang.plugin.profile`)
charges each round's time, exclusively, to SGLang's calls (``sglang:``) and the plugin's hooks (``hook:``); a
second engine with ``TREESPEC_PROFILE_OPS=1`` counts each hook's ATen ops and host reads per round. Both are
printed per set beside native: ms per round, the plugin's share, and the parts that differ most from native.

On the CPU the engine is SGLang's CPU engine with our stand-ins (float32); with ``--device cuda`` it is an
in-process ``sgl.Engine`` with CUDA graphs on (``--attention triton|flashinfer``, ``--dtype``), and ``--sync``
charges each part the device time of the work it queued (``TREESPEC_PROFILE_SYNC``). ``--select torch,triton``
runs one engine per selection (``TREESPEC_SELECT``), side by side in one run; ``--ragged 0,1,tuned`` one per ragged
verify setting too (``TREESPEC_RAGGED_VERIFY``: with ``--attention flashinfer``, padded in the verify graph
against ragged and eager, per batch size); ``--draft demo-eagle3`` serves the shipped EAGLE-3 head; ``--target random``
a target of the demo target's shape with random weights and no tokenizer (round times and outputs only, accept
lengths mean nothing; no demo target files needed). With ``--plain`` every set's greedy
outputs are compared with the plain engine's (``== plain``: the requests that differ, each at its first differing
token, as ``request@position:token/plain's``); native runs first and again last, so its spread shows beside the gaps,
and ``--passes K`` serves every set K times in turn, each pass a share of the prompts (ms per round: the median).

    python bench/plugin_round_profile.py --bs 1,4 --out bench/measured/<machine>/plugin_round_profile.json
    python bench/plugin_round_profile.py --device cuda --bs 1,16,64 --prompts 64 --plain --select auto,torch
    python bench/plugin_round_profile.py --device cuda --attention flashinfer --dtype bfloat16 --bs 1,16,64 \
        --prompts 64 --ragged 0,1,tuned
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

# the repository's root: bench.round_pairs, bench.random_target
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.profile_rows import delta, differences, pooled, summary  # noqa: E402
from bench.random_target import RANDOM_PREFIX, random_prompt_ids, random_target  # noqa: E402,F401 (the CLI's)


def policy_sets(topk: int, steps: int, n: int) -> dict:
    one = {"eagle2": {"policy": "eagle2", "budget": n, "topk": topk, "depth": steps},
           "talon": {"policy": "talon", "budget": n, "topk": topk, "mu": 0.03},
           "salf": {"policy": "salf", "budget": n, "batch": min(4, n), "th": 0.1},
           "c2t": {"policy": "c2t", "budget": n, "topk": topk, "beta": 0.5},
           "chain": {"policy": "chain", "length": steps}}
    sets = {"native": [None]}
    sets.update({name: [spec] for name, spec in one.items()})
    # eagle2 at budget N keeps SGLang's own tree (served natively); a smaller budget is a tree of its own
    sets["eagle2-small"] = [{"policy": "eagle2", "budget": max(2, n - 2), "topk": topk, "depth": steps}]
    sets["mix"] = [None] + list(one.values())  # request i takes mix[i % 6]
    sets["native_again"] = [None]  # native once more after the policies: the run-to-run spread beside the gaps
    return sets


def start(a, env: dict, speculative: bool = True):
    """An engine whose processes profile into ``env["TREESPEC_PROFILE"]`` (``speculative=False``: plain decoding):
    ``(generate(ids, params) -> outputs, stop())``."""
    from treespec_sglang.models.demo import demo_target
    from treespec_sglang.plugin.cpu.host import EngineHost, cpu_engine_kwargs, eagle_kwargs

    draft = draft_dir(a)
    spec = eagle_kwargs(draft, a.topk, a.steps, a.num_draft_tokens) if speculative else {}
    model = getattr(a, "model_path", None) or demo_target()
    if a.target == "random":
        spec["skip_tokenizer_init"] = True  # a random target ships no tokenizer: ids in, ids out
    if a.device == "cpu":
        host = EngineHost("profile", cpu_engine_kwargs(model, **spec), tempfile.mkdtemp(), env=env)
        return lambda ids, sp: host.generate(input_ids=ids, sampling_params=sp), host.close
    os.environ.update(env)  # inherited by the scheduler processes
    import sglang as sgl
    # greedy: the sampling backend draws nothing; pytorch's spares FlashInfer's sampling JIT on a new GPU machine
    llm = sgl.Engine(model_path=model, dtype=a.dtype, attention_backend=a.attention, sampling_backend="pytorch",
                     mem_fraction_static=0.35, cuda_graph_max_bs_decode=max(64, max(a.bs)), random_seed=0,
                     log_level="warning", disable_prefill_cuda_graph=True, **spec)
    return lambda ids, sp: llm.generate(input_ids=ids, sampling_params=sp), llm.shutdown


def draft_dir(a) -> str:
    from treespec_sglang.engine.loading import demo_draft_dir, eagle3_draft_dir

    return eagle3_draft_dir() if a.draft == "demo-eagle3" else demo_draft_dir()


def params_for(specs, n: int, max_new_tokens: int, ignore_eos: bool = False) -> list:
    """Request i's sampling params: greedy, ``specs[i % len(specs)]`` as its policy (None: native); ``ignore_eos``
    (a random target): every request runs ``max_new_tokens``."""
    return [{"max_new_tokens": max_new_tokens, "temperature": 0.0, **({"ignore_eos": True} if ignore_eos else {}),
             **({"custom_params": {"treespec": specs[i % len(specs)]}} if specs[i % len(specs)] else {})}
            for i in range(n)]


def serve(generate, prompt_ids, sp, bs: int, n: int = 0) -> dict:
    """The prompts ``bs`` at a time (the concurrency): tokens per second and tau over every request; with ``n``
    (SGLang's N) also the share of treespec request-rounds the target verified at N tokens (``padded``; a request
    whose tree keeps all N nodes counts too, and a ragged forward can hold one: per forward, one request at a time)
    and the mean verified tokens (``treespec_verify_tokens``). ``treespec:verify_forwards_total`` counts forwards."""
    return summary(*generated(generate, prompt_ids, sp, bs), n)


def generated(generate, prompt_ids, sp, bs: int) -> tuple:
    """``(seconds, outputs)``: the prompts served ``bs`` at a time, and the wall time it took."""
    t, outs = time.time(), []
    for i in range(0, len(prompt_ids), bs):
        outs += generate(prompt_ids[i:i + bs], sp[i:i + bs])
    return time.time() - t, outs


def warm(generate, prompt_ids, bs: int, specs=(None,)) -> None:
    """One untimed batch of ``bs`` requests per entry of ``specs`` (None: native), 4 tokens each: a batch size's first
    rounds compile kernels for its shapes and capture the selection graph of its bucket (on an H100 they cost a first
    native set at bs 16 and 64 4-13x its later rounds, and the first policy set the selection graph's capture)."""
    for spec in specs:
        generate(prompt_ids[:bs], params_for([spec], min(bs, len(prompt_ids)), 4))


def run_plain(a, prompt_ids) -> dict:
    """``{bs: {"tok_s", "outputs"}}`` of plain decoding (no speculation) on the same prompts: its tokens per second
    and its greedy outputs (what every set's outputs are compared with)."""
    generate, stop = start(a, {}, speculative=False)
    try:
        sp = params_for([None], len(prompt_ids), a.max_new_tokens, a.target == "random")
        out = {}
        for bs in a.bs:
            warm(generate, prompt_ids, bs)
            out[bs] = serve(generate, prompt_ids, sp, bs)
        return out
    finally:
        stop()


def engines(a) -> dict:
    """``{label: environment}``: one engine per ``--select`` value, times one per ``--ragged`` value when given (the
    label then names it; without ``--ragged`` the operator's ``TREESPEC_RAGGED_VERIFY``, if any, stays)."""
    out = {}
    for select in a.select.split(","):
        for r in (a.ragged.split(",") if a.ragged else [None]):
            env = {"TREESPEC_SELECT": select}
            if r is not None:
                env["TREESPEC_RAGGED_VERIFY"] = r
            out[select if r is None else f"{select} ragged={r}"] = env
    return out


def profile_env(a, directory: str, ops: bool) -> dict:
    """The round profiler's settings for an engine profiling into ``directory`` (``ops``: count each hook's ATen ops
    and host reads; ``a.sync``: charge each part its device time)."""
    return {"TREESPEC_PROFILE": directory, "TREESPEC_PROFILE_OPS": "1" if ops else "0",
            "TREESPEC_PROFILE_SYNC": "1" if a.sync else "0"}


def write_out(a, figures: dict) -> None:
    """``--out``: ``figures`` as JSON with the machine and the arguments, its folder made if need be."""
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"machine": machine(a.device), "args": vars(a), **figures}, f, indent=1)


def run_sets(a, prompt_ids, ops: bool, select: str = "torch", plain: dict = None, env: dict = None) -> dict:
    """``{bs: {set: {kind: per_round(...), "tok_s", "tau", "seconds", "differing"}}}`` from one engine (``ops``:
    the op-counting engine; ``select``: its label; ``env``: its settings (:func:`engines`; default
    ``TREESPEC_SELECT=select``); ``plain``: :func:`run_plain`'s, whose outputs each set's are compared with:
    ``differing`` as :func:`differences`, None without ``plain``)."""
    from treespec_sglang.plugin.profile import read_profile

    d = tempfile.mkdtemp()
    env = {**profile_env(a, d, ops), **(env or {"TREESPEC_SELECT": select})}
    generate, stop = start(a, env)
    out = {}
    try:
        sets = policy_sets(a.topk, a.steps, a.num_draft_tokens)
        k = max(1, a.passes)
        shares = [list(range(p, len(prompt_ids), k)) for p in range(k)]  # pass p serves prompts p, p + k, ...
        for bs in a.bs:
            warm(generate, prompt_ids, bs, sets["mix"])  # not measured: every policy's kernels at this size
            runs = {name: [] for name in sets}
            for idx in shares:  # every set once per pass, in turn: a drift of the machine reaches them alike
                ids = [prompt_ids[i] for i in idx]
                for name, specs in sets.items():
                    before = read_profile(d)
                    sp = params_for(specs, len(ids), a.max_new_tokens, a.target == "random")
                    seconds, outs = generated(generate, ids, sp, bs)
                    runs[name].append((idx, seconds, outs, delta(read_profile(d), before)))
            for name, passes in runs.items():
                row = out.setdefault(bs, {})[name] = pooled(passes, a.num_draft_tokens)
                served = {key: row[key] for key in ("tok_s", "tau", "verified", "padded")}
                outputs, ref = row.pop("outputs"), (plain or {}).get(bs)
                row["differing"] = None if ref is None else differences(outputs, ref["outputs"])
                kinds = ", ".join(f"{k}: {r['rounds']} rounds {r['ms']:.2f} ms (plugin {r['plugin_ms']:.2f})"
                                  for k, r in row.items() if isinstance(r, dict))
                eq = "" if row["differing"] is None else \
                    f", == plain {len(prompt_ids) - len(row['differing'])}/{len(prompt_ids)} {row['differing']}"
                ver = "" if served["verified"] is None else \
                    f", verified {served['verified']:.2f} ({100 * served['padded']:.0f}% of request-rounds at N)"
                print(f"{select}{' ops' if ops else ''} bs {bs} {name}: {served['tok_s']:.1f} tok/s, tau "
                      f"{served['tau'] or 0:.2f}{ver}{eq}; {kinds}", flush=True)
    finally:
        stop()
    return out


def report(timed: dict, counted: dict, plain: dict, select: str) -> str:
    """A markdown table per concurrency: each set's tok/s, tau and ms per round beside native's (run first and,
    as ``native_again``, last), its largest extras over native, and how many of its outputs equal plain greedy's."""
    lines = []
    for bs, sets in timed.items():
        nat = sets["native"]["native"]
        spread = nat.get("ms_passes")
        again = sets.get("native_again", {})
        base = plain.get(bs)
        lines += [f"\n{select} selection, bs {bs}: native {sets['native']['tok_s']:.1f} tok/s, "
                  f"{nat['ms']:.2f} ms per round (SGLang {nat['sglang_ms']:.2f}, plugin hooks {nat['plugin_ms']:.3f})"
                  + (f", passes {min(spread):.2f}-{max(spread):.2f} ms" if spread else "")
                  + (f"; native again {again['tok_s']:.1f} tok/s, {again['native']['ms']:.2f} ms"
                     if "native" in again else "")
                  + (f"; plain {base['tok_s']:.1f} tok/s" if base else ""), "",
                  "| set | tok/s | tau | ms per round | vs native | plugin ms | plugin ops / host reads per round | "
                  "largest extras over native (ms) | == plain |", "|---|---|---|---|---|---|---|---|---|"]
        for name, row in sets.items():
            r = row.get("ts")
            if name == "native" or r is None:
                continue
            extra = {k: v - nat["parts"].get(k, 0.0) for k, v in r["parts"].items()}
            top = sorted(extra.items(), key=lambda kv: -abs(kv[1]))[:4]
            ops = counted.get(bs, {}).get(name, {}).get("ts", {}).get("ops", {})
            o, rd = sum(v[0] for v in ops.values()), sum(v[1] for v in ops.values())
            diff = row.get("differing")
            eq = "-" if diff is None else " ".join([f"{len(diff)} differ"] +
                                                    [f"{i}@{p}:{t}/{w}" for i, p, t, w in diff])
            lines.append(f"| {name} | {row['tok_s']:.1f} | {row['tau'] or 0:.2f} | {r['ms']:.2f} | "
                         f"{r['ms'] - nat['ms']:+.2f} | {r['plugin_ms']:.2f} | {o:.0f} / {rd:.1f} | "
                         + ", ".join(f"{k} {v:+.2f}" for k, v in top) + f" | {eq} |")
    return "\n".join(lines)


def machine(device: str) -> str:
    """The CPU (model name, bf16 feature, cores) or the GPU the figures were measured on."""
    import torch
    from treespec_sglang.engine.cost import _cpu_name
    from treespec_sglang.engine.dtypes import cpu_bf16
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{_cpu_name()} ({cpu_bf16()[1]}), {os.cpu_count()} cores, torch {torch.__version__}"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--attention", default="triton", choices=("triton", "flashinfer"),
                    help="CUDA: SGLang's attention backend (FlashInfer: --dtype bfloat16 or float16)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sync", action="store_true", help="CUDA: charge each part its device time")
    ap.add_argument("--bs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (alternating HumanEval / MT-bench)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--passes", type=int, default=1,
                    help="serve every set this many times in turn, each pass a share of the prompts; ms per round is "
                         "the median of the passes")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--no-ops", action="store_true", help="skip the op-counting engine")
    ap.add_argument("--plain", action="store_true", help="also a plain engine (no speculation): its tok/s")
    ap.add_argument("--select", default="torch", help="comma list of TREESPEC_SELECT values, one engine each")
    ap.add_argument("--ragged", default=None, help="comma list of TREESPEC_RAGGED_VERIFY values, one engine each")
    ap.add_argument("--target", default="demo", choices=("demo", "random"),
                    help="random: the demo target's shape with random weights, no tokenizer (round times only)")
    ap.add_argument("--draft", default="demo", choices=("demo", "demo-eagle3"), help="the shipped EAGLE / EAGLE-3 head")
    ap.add_argument("--paired", type=int, default=0,
                    help="K: instead of the sets in turn, K ABBA blocks (native, set, set, native) per set of --sets "
                         "and concurrency, the gap to native per block (bench/round_pairs.py); no op counts")
    ap.add_argument("--paired-batches", type=int, default=2,
                    help="--paired: full batches each run of a block serves (bs x this many prompts, taken in turn)")
    ap.add_argument("--sets", default="native,eagle2,eagle2-small,mix",
                    help="--paired: comma list of the sets to pair with native (native itself: the noise floor)")
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before any engine starts: FlashInfer has no float32 attention kernels (its JIT
    modules take fp16, bf16 and fp8), so SGLang's FlashInfer backend would fail at its first forward."""
    ap = parser()
    a = ap.parse_args(argv)
    if a.device == "cuda" and a.attention == "flashinfer" and a.dtype == "float32":
        ap.error("--attention flashinfer needs --dtype bfloat16 or float16: FlashInfer has no float32 kernels")
    if a.paired:
        known = [n for n in policy_sets(a.topk, a.steps, a.num_draft_tokens) if n != "native_again"]
        unknown = [n for n in a.sets.split(",") if n not in known]
        if unknown:
            ap.error(f"--sets takes names from {known}, got {unknown}")
        if not 1 <= a.paired <= 1000:
            ap.error(f"--paired must be 0 (off) or in [1, 1000], got {a.paired}")
        if not 1 <= a.paired_batches <= 1000:
            ap.error(f"--paired-batches must be in [1, 1000], got {a.paired_batches}")
        if a.plain:
            ap.error("--paired compares round times only: drop --plain (the sets' outputs are checked without it)")
    return a


def main(argv=None):
    a = parse_args(argv)
    from treespec_sglang.data.prompts import humaneval, mtbench
    from treespec_sglang.engine import SpecEngine

    scratch = tempfile.mkdtemp(prefix=RANDOM_PREFIX) if a.target == "random" else None  # ~540 MB, removed after
    try:
        if scratch is not None:
            a.model_path = random_target(scratch, draft_dir(a))
            with open(os.path.join(a.model_path, "config.json")) as f:
                prompt_ids = random_prompt_ids(a.prompts, json.load(f)["vocab_size"])
        else:
            he, mt = humaneval().every(10), mtbench().every(10)
            prompts = [x for pair in zip(he.prompts, mt.prompts) for x in pair][:a.prompts]
            prompt_ids = SpecEngine.from_pretrained("smollm2-135m", draft=None).encode(prompts)
        report_runs(a, prompt_ids)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def report_runs(a, prompt_ids) -> None:
    """Every engine's runs on ``prompt_ids`` (plain first with ``--plain``), the tables printed, ``--out`` written."""
    if a.paired:
        from bench.round_pairs import report_paired
        return report_paired(a, prompt_ids)
    plain = run_plain(a, prompt_ids) if a.plain else {}
    timed, counted, tables = {}, {}, []
    for label, env in engines(a).items():
        timed[label] = run_sets(a, prompt_ids, ops=False, select=label, plain=plain, env=env)
        counted[label] = {} if a.no_ops else run_sets(a, prompt_ids, ops=True, select=label, env=env)
        tables.append(report(timed[label], counted[label], plain, label))
    table = "\n".join(tables)
    print(table)
    write_out(a, {"plain_tok_s": {bs: p["tok_s"] for bs, p in plain.items()}, "timed": timed, "counted": counted,
                  "table": table})


if __name__ == "__main__":
    main()
