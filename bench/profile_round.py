"""Where a speculative round's time goes: exclusive wall time per component.

The engine's pieces are wrapped with timers (no change to the engine itself); a component's time
excludes the components called inside it, so the rows add up to the round. Components:

- ``verify forward``  the target's forward over the trees (``LlamaModel.forward``)
- ``target LM head``  ``lm_head`` + float cast on the verified nodes
- ``draft forward``   the draft head's decoder layer (tree expansion and the draft extend)
- ``draft LM head``   the draft's (reduced-vocab) LM head + log_softmax
- ``tree build``      ``grow_tree`` / the policy itself, draft calls excluded
- ``verify walk``     ``verify_tree`` (greedy / sampling acceptance)
- ``KV commit``       ``KVCache.compact``
- ``other``           masks, gathers, the host read, Python (the round minus the rows above)

Usage::

    python bench/profile_round.py --dtype float32,bfloat16 --policy talon --prompts 3 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch


class Clock:
    """Exclusive timers: time spent in a nested timed call is charged to the inner name only."""

    def __init__(self):
        self.excl = defaultdict(float)
        self.calls = defaultdict(int)
        self.stack = []

    def wrap(self, name, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            self.stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                inner = self.stack.pop()
                self.excl[name] += dt - inner
                self.calls[name] += 1
                if self.stack:
                    self.stack[-1] += dt
        return timed


def profile(engine, prompts, spec, max_new_tokens):
    import treespec_sglang.engine.round as E  # the round's stages call the policy and the walk from here
    from treespec_sglang.engine.kv_cache import KVCache

    clock = Clock()
    saved = []  # (object, attribute, original): a list, as some objects (dataclasses) are unhashable

    def patch(obj, attr, name):
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, clock.wrap(name, getattr(obj, attr)))

    patch(E, "grow_tree", "tree build")
    patch(E, "verify_tree", "verify walk")
    patch(E, "walk_greedy", "verify walk")
    patch(KVCache, "compact", "KV commit")
    patch(engine, "_round", "other")
    patch(engine.calls, "logits", "target LM head")  # the model calls every stage takes (engine/calls.py)
    patch(engine.calls, "draft_logprobs", "draft LM head")
    patch(engine.target, "forward", "verify forward")
    patch(engine.draft, "forward", "draft forward")
    patch(engine, "_plain", "plain")
    try:
        out, t0 = [], time.perf_counter()
        for p in prompts:
            out += engine.generate([p], max_new_tokens=max_new_tokens, policy=spec)
        wall = time.perf_counter() - t0
    finally:
        for obj, attr, fn in saved:
            if isinstance(obj, type) or obj is E:
                setattr(obj, attr, fn)
            else:
                delattr(obj, attr) if attr in vars(obj) else None
    rounds = clock.calls["other"] or clock.calls["verify forward"]
    toks = sum(len(r.token_ids) for r in out)
    acc = [a for r in out for a in r.stats.accepted]
    return dict(wall_s=wall, tokens=toks, rounds=rounds, tau=1 + sum(acc) / max(len(acc), 1),
                ms_per_round={k: 1e3 * v / max(rounds, 1) for k, v in clock.excl.items()},
                calls_per_round={k: v / max(rounds, 1) for k, v in clock.calls.items()}, out=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--policy", default="talon", help="a preset name of `treespec demo` or 'plain'")
    ap.add_argument("--policy-json", default=None)
    ap.add_argument("--prompts", type=int, default=3, help="held-out prompts (alternating HumanEval / MT-bench)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft", default="demo", help="draft directory (default: the shipped head)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    from treespec_sglang.engine.runs import PRESETS
    from treespec_sglang.data import humaneval, mtbench
    from treespec_sglang.engine import SpecEngine

    if a.threads:
        torch.set_num_threads(a.threads)
    he, mt = humaneval().every(10), mtbench().every(10)
    prompts = [x for pair in zip(he.prompts, mt.prompts) for x in pair][:a.prompts]
    spec = json.loads(a.policy_json) if a.policy_json else (None if a.policy == "plain" else PRESETS[a.policy])
    rows = []
    for name in a.dtype.split(","):
        dtype = getattr(torch, name)
        engine = SpecEngine.from_pretrained("smollm2-135m", draft=a.draft, dtype=dtype)
        engine.generate(prompts[:1], max_new_tokens=4, policy=spec)  # warm-up
        r = profile(engine, prompts, spec, a.max_new_tokens)
        base = profile(engine, prompts, None, a.max_new_tokens) if spec is not None else r
        r.update(dtype=name, plain_wall_s=base["wall_s"], plain_ms_per_token=1e3 * base["wall_s"] / base["tokens"])
        rows.append(r)
        label = "plain" if spec is None else spec.get("policy", a.policy)  # --policy-json names its own
        print(f"\n{name}: {label} {spec}  {r['tokens']} tokens in {r['rounds']} rounds, tau {r['tau']:.2f}, "
              f"{r['wall_s']:.2f} s (plain {base['wall_s']:.2f} s: {base['wall_s'] / r['wall_s']:.2f}x)")
        total = sum(v for k, v in r["ms_per_round"].items())
        for k, v in sorted(r["ms_per_round"].items(), key=lambda kv: -kv[1]):
            print(f"  {k:<16} {v:7.2f} ms/round  {100 * v / total:5.1f}%  calls/round {r['calls_per_round'][k]:.2f}")
        print(f"  {'total':<16} {total:7.2f} ms/round; plain {r['plain_ms_per_token']:.2f} ms/token")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "out"} for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
