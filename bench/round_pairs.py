"""Native against a policy set in ABBA blocks on one engine: the gap in ms per decode round, the drift cancelled.

A set's round time moves with its place in a run (kernels compiling, clocks, caches warming): on an H100 native
against itself moved 0.42-0.80 ms within one call, more than the 0.1 ms the issue's "an eagle2 round within 0.1 ms
of a native round" asks to tell. Each block serves one share of the prompts four times in a row, native, the set,
the set, native (ABBA): a drift linear in time adds the same to the set's two runs as to native's two, so the
block's gap (the set's mean ms per decode round minus native's) holds the set's own cost and the noise only. A block
of native against itself (set ``native``) is the control: its gaps are the noise floor the other gaps are read
against. Per set the blocks' gaps are summarised by their median and range, and by the wall time's ratio (the set's
seconds over native's in each block: tokens per second where, as on a random target, both runs emit the same
tokens). The runs' greedy outputs are checked too: each of the set's two runs against the block's first native
run on the same prompts (SGLang's own EAGLE, so a step that times the rounds also checks that the sets change no
output; native against itself: the engine's own determinism).

``bench/plugin_round_profile.py --paired K --sets eagle2,eagle2-small,mix`` runs it (K blocks per set and
concurrency; at concurrency bs block j serves ``--paired-batches`` B full batches, the prompts ``j * bs * B`` on,
taken in turn from the prompt list, so every concurrency is served at its width whatever the list's length):

    python bench/plugin_round_profile.py --device cuda --target random --select auto --bs 1,16,64 --prompts 64 \
        --max-new-tokens 16 --paired 8 --sets native,eagle2,eagle2-small,mix --out paired.json
"""

from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from bench.profile_rows import differences

NATIVE = "native"
DECODE_KINDS = ("ts", NATIVE)  # the profiler's decode-round kinds (a prefill or idle call is a round of its own)


def abba(sets: Sequence[str], blocks: int) -> List[Tuple[int, str, str]]:
    """The runs in order: ``(block, the block's set, the run's place)`` where block j serves prompt share j
    (:func:`share`); for each share, each set in ``sets`` gets a block of native, the set, the set, native
    (places ``"a1", "b1", "b2", "a2"``: an ``a`` run serves native)."""
    return [(j, name, place) for j in range(blocks) for name in sets for place in ("a1", "b1", "b2", "a2")]


def share(prompt_ids: Sequence, j: int, bs: int, batches: int) -> list:
    """Block j's prompts at concurrency ``bs``: ``batches`` full batches, ``bs * batches`` prompts from position
    ``j * bs * batches`` on, in turn through ``prompt_ids`` (wrapping around)."""
    n = bs * batches
    return [prompt_ids[(j * n + i) % len(prompt_ids)] for i in range(n)]


def decode_ms(prof: dict) -> float:
    """ms per decode round of a profile delta (``{kind: {"rounds", "round_s", ...}}``), native and treespec rounds
    together (a mixed batch's rounds are ``ts``); NaN without a decode round."""
    rounds = sum(prof.get(k, {}).get("rounds", 0) for k in DECODE_KINDS)
    seconds = sum(prof.get(k, {}).get("round_s", 0.0) for k in DECODE_KINDS)
    return 1e3 * seconds / rounds if rounds else float("nan")


def paired(run: Callable[[int, str], tuple], sets: Sequence[str], blocks: int) -> Dict[str, dict]:
    """Run :func:`abba`'s schedule with ``run(block, set) -> (ms per decode round, wall seconds[, outputs])`` and
    summarise each set: ``{"gaps": [per block: set's mean ms - native's], "median", "lo", "hi", "wall_ratio": [per
    block: set's seconds / native's], "native_ms": [per block: native's mean], "set_ms": [...], "differing": [per
    block: its requests whose output in the set's run b1 or b2 is not native's in a1, as (run, request, position,
    token, native's token) at the first differing token] or None (no outputs)}``."""
    got: Dict[Tuple[int, str], Dict[str, tuple]] = {}
    for j, name, place in abba(sets, blocks):
        got.setdefault((j, name), {})[place] = run(j, NATIVE if place[0] == "a" else name)
    out = {}
    for name in sets:
        rows = [got[(j, name)] for j in range(blocks)]
        nat = [(r["a1"][0] + r["a2"][0]) / 2 for r in rows]
        own = [(r["b1"][0] + r["b2"][0]) / 2 for r in rows]
        gaps = [b - a for a, b in zip(nat, own)]
        wall = [(r["b1"][1] + r["b2"][1]) / (r["a1"][1] + r["a2"][1]) for r in rows]
        out[name] = {"gaps": gaps, "median": statistics.median(gaps), "lo": min(gaps), "hi": max(gaps),
                     "wall_ratio": wall, "native_ms": nat, "set_ms": own, "differing": _differing(rows)}
    return out


def _differing(rows: Sequence[Dict[str, tuple]]) -> Optional[List[list]]:
    """Per block, the set's runs' outputs against native's first run (None when a run gave no outputs)."""
    if any(len(r[p]) < 3 or r[p][2] is None for r in rows for p in ("a1", "b1", "b2")):
        return None
    return [[(p,) + d for p in ("b1", "b2") for d in differences(r[p][2], r["a1"][2])] for r in rows]


def differing_requests(r: dict) -> Optional[int]:
    """How many (block, request) pairs of a set's summary differ from native's output in either run (None: not
    checked)."""
    if r.get("differing") is None:
        return None
    return sum(len({d[1] for d in block}) for block in r["differing"])


def table(results: Dict[int, Dict[str, dict]], label: str) -> str:
    """Markdown per concurrency: each set's native and own ms per decode round (medians over blocks), the gap's
    median and range, the wall-time ratio's median, and how many requests' outputs differ from native's (-: not
    checked)."""
    lines = []
    for bs, sets in results.items():
        lines += [f"\n{label}, bs {bs}: ABBA blocks, ms per decode round (native against itself: the noise floor)", "",
                  "| set | blocks | native ms | set ms | gap median (range) | wall time / native's "
                  "| outputs != native's |", "|---|---|---|---|---|---|---|"]
        for name, r in sets.items():
            n = differing_requests(r)
            lines.append(f"| {name} | {len(r['gaps'])} | {statistics.median(r['native_ms']):.3f} | "
                         f"{statistics.median(r['set_ms']):.3f} | {r['median']:+.3f} ({r['lo']:+.3f} .. "
                         f"{r['hi']:+.3f}) | {statistics.median(r['wall_ratio']):.3f} | "
                         f"{'-' if n is None else n} |")
    return "\n".join(lines)


def run_paired(a, prompt_ids, label: str, env: dict) -> Dict[int, Dict[str, dict]]:
    """``{bs: paired(...)}`` from one engine of ``bench/plugin_round_profile.py`` (``env``: its settings), each
    concurrency warmed first with every set's policies (their kernels and selection graphs), then ``a.paired``
    ABBA blocks per set of ``a.sets`` (comma list), :func:`share` j in block j."""
    import tempfile

    from bench.plugin_round_profile import generated, params_for, policy_sets, profile_env, start, warm
    from bench.profile_rows import delta
    from treespec_sglang.plugin.profile import read_profile

    every = policy_sets(a.topk, a.steps, a.num_draft_tokens)
    names = a.sets.split(",")
    d = tempfile.mkdtemp()
    generate, stop = start(a, {**profile_env(a, d, ops=False), **env})
    k = a.paired
    out = {}
    try:
        for bs in a.bs:
            warm(generate, prompt_ids, bs, [s for n in names for s in every[n]])

            def run(j: int, name: str) -> Tuple[float, float]:
                ids = share(prompt_ids, j, bs, a.paired_batches)
                before = read_profile(d)
                sp = params_for(every[name], len(ids), a.max_new_tokens, a.target == "random")
                seconds, outs = generated(generate, ids, sp, bs)
                return decode_ms(delta(read_profile(d), before)), seconds, [list(o["output_ids"]) for o in outs]

            out[bs] = paired(run, names, k)
            for name, r in out[bs].items():
                print(f"{label} paired bs {bs} {name}: gap {r['median']:+.3f} ms ({r['lo']:+.3f} .. {r['hi']:+.3f}) "
                      f"over {k} blocks, outputs != native's: {differing_requests(r)}", flush=True)
    finally:
        stop()
    return out


def report_paired(a, prompt_ids) -> None:
    """``--paired``: every engine's ABBA blocks (:mod:`bench.round_pairs`), the tables printed, ``--out`` written."""
    from bench.plugin_round_profile import engines, write_out

    got, tables = {}, []
    for label, env in engines(a).items():
        got[label] = run_paired(a, prompt_ids, label, env)
        tables.append(table(got[label], label))
    text = "\n".join(tables)
    print(text)
    write_out(a, {"paired": got, "table": text})
