"""Held-out acceptance alpha per draft position for several draft heads on the same data.

The held-out sequences are every 10th prompt of each prompt set in a ``treespec train data``
directory (the split ``treespec train draft`` never trains on and ``treespec bench --every 10``
reports). Alpha at position k is the expected acceptance of the draft's step-k distribution
against the target's (TTT step k: the draft fed its own features k times), over the full target
vocabulary (a token map's missing mass counts as rejected).

Usage::

    python bench/draft_alpha.py --data data/distill2 --drafts /tmp/old-draft,treespec_sglang/assets/smollm2-135m-eagle
"""

from __future__ import annotations

import argparse
import json


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--drafts", required=True, help="comma-separated draft directories")
    ap.add_argument("--positions", type=int, default=4)
    ap.add_argument("--heldout-every", type=int, default=10)
    a = ap.parse_args(argv)
    import torch

    from treespec_sglang.engine import SpecEngine
    from treespec_sglang.training.data import heldout_flags, iter_sequences, load_shards
    from treespec_sglang.training.trainer import TrainConfig, evaluate_alpha

    seqs = iter_sequences(load_shards(a.data))
    flags = heldout_flags(a.data, a.heldout_every)
    held = [s for s, f in zip(seqs, flags) if f]
    cfg = TrainConfig(ttt_steps=a.positions, batch_size=8)
    rows = {}
    for d in a.drafts.split(","):
        e = SpecEngine.from_pretrained("smollm2-135m", draft=d, dtype="float32", fuse=False)
        with torch.inference_mode():
            rows[d] = evaluate_alpha(e.draft, e.target.lm_head, held, cfg, e.token_map)
        print(f"{d}: held-out alpha per position {[round(x, 3) for x in rows[d]]} ({len(held)} sequences)", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
