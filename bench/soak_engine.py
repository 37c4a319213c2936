"""Soak: many verify rounds of ``SpecEngine`` with mixed per-request policies, watching RSS (not a test).

A small random Llama (built here, like the tests' tiny models, so rounds are cheap) runs batches that mix
every policy, plain requests, bad requests and T > 0, until ``--rounds`` verify rounds have run. RSS is
sampled after every batch; the report compares the mean RSS of the first and last quarter of the run
(after a warm-up batch) and the largest step.

    python bench/soak_engine.py --rounds 10000
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.models.tiny


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from tests.models.tiny import make_tiny_llama
    from treespec_sglang.engine import SpecEngine

    torch.set_num_threads(1)
    path = tempfile.mkdtemp()
    make_tiny_llama(path, vocab=128, hidden=64, layers=2, heads=4, kv_heads=2)
    engine = SpecEngine.from_pretrained(path, draft=None, seed=0)
    specs = [{"policy": "eagle2", "budget": 16, "topk": 4, "depth": 4}, {"policy": "talon", "budget": 16, "topk": 4},
             {"policy": "salf", "budget": 12}, {"policy": "c2t", "budget": 16, "topk": 4},
             {"policy": "chain", "length": 4}, {"policy": "chain", "length": 4, "beta": 0.3}, None,
             {"policy": "talon", "mu": 7}]  # the last one is refused per request
    rng = random.Random(0)
    rounds, samples, batches, t0 = 0, [], 0, time.time()
    while rounds < a.rounds:
        prompts = [[rng.randrange(128) for _ in range(rng.randrange(4, 40))] for _ in range(a.batch)]
        pol = [rng.choice(specs) for _ in range(a.batch)]
        temp = rng.choice([0.0, 0.0, 1.0])
        res = engine.generate(prompts, max_new_tokens=a.max_new_tokens, policy=pol, temperature=temp, seed=batches)
        rounds += max(r.stats.rounds for r in res)
        batches += 1
        samples.append((rounds, rss_mb()))
    q = max(1, len(samples) // 4)
    first = sum(s for _, s in samples[1:q + 1]) / q
    last = sum(s for _, s in samples[-q:]) / q
    step = max(b - a_ for (_, a_), (_, b) in zip(samples, samples[1:]))
    report = dict(rounds=rounds, batches=batches, seconds=time.time() - t0, rss_first_quarter_mb=first,
                  rss_last_quarter_mb=last, rss_growth_mb=last - first, largest_step_mb=step,
                  rss_start_mb=samples[0][1], rss_end_mb=samples[-1][1])
    print(json.dumps(report, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"report": report, "samples": samples}, f)


if __name__ == "__main__":
    main()
