"""Copy the sequences of some prompt sets out of a self-distillation directory into a new one.

Keeps every kept set's sequences in their stored order, so ``split_roles`` gives each sequence the
same role (test / val / train) in the copy as in the source: a set's k-th sequence stays its k-th.
Example: ``--sets humaneval,mtbench`` on the stored tokens keeps 164 + 80 sequences, and
``humaneval/HumanEval/10`` is held out in both.

    python bench/subset_distill.py --src bench/data/smollm2-distill-tokens --sets humaneval,mtbench \\
        --out data/e3ft/tokens
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main(argv=None):
    from safetensors.torch import load_file, save_file

    from treespec_sglang.training.data import MANIFEST, write_manifest

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", required=True)
    ap.add_argument("--sets", required=True, help="comma-separated prompt-set names (the ids' first part)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    keep_sets = {s.strip() for s in a.sets.split(",") if s.strip()}
    with open(os.path.join(a.src, MANIFEST)) as f:
        man = json.load(f)
    shards = [load_file(os.path.join(a.src, name)) for name in man["shards"]]  # tokens-only shards have no hidden
    has_hidden = "hidden" in shards[0]

    def sequences():
        for t in shards:
            off = t["offsets"].tolist()
            for lo, hi in zip(off[:-1], off[1:]):
                yield t["tokens"][lo:hi], (t["hidden"][lo:hi] if has_hidden else None), t["loss_mask"][lo:hi]

    seqs, ids = [], []
    for pid, seq in zip(man["done"], sequences()):
        if pid.split("/", 1)[0] in keep_sets:
            ids.append(pid)
            seqs.append(seq)
    if not seqs:
        raise SystemExit(f"--sets {a.sets}: no sequence of {a.src} belongs to these sets")
    out = {"tokens": torch.cat([t for t, _, _ in seqs]).int(),
           "loss_mask": torch.cat([m for _, _, m in seqs]).bool(),
           "offsets": torch.tensor([0] + [len(t) for t, _, _ in seqs]).cumsum(0)}
    if has_hidden:
        out["hidden"] = torch.cat([h for _, h, _ in seqs])
    os.makedirs(a.out, exist_ok=True)
    save_file(out, os.path.join(a.out, "shard-00000.safetensors"))
    write_manifest(os.path.join(a.out, MANIFEST), {
        "format": man["format"], "done": ids, "shards": ["shard-00000.safetensors"],
        "tokens": int(out["tokens"].numel()), "answer_tokens": int(out["loss_mask"].sum()),
        "note": f"sets {sorted(keep_sets)} of {a.src}"})
    print(f"{a.out}: {len(ids)} sequences, {int(out['tokens'].numel())} tokens")


if __name__ == "__main__":
    main()
