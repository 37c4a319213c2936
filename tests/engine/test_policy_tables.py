"""The shipped heads' acceptance tables are measured on prompts their head never trained on and that are not the
held-out test split the benchmarks report: each table lists its prompts, checked against the head's own
``training.json``."""

import json
import os
import re

import pytest

from treespec_sglang.engine.cost import load_policy_table
from treespec_sglang.engine.loading import demo_draft_dir, eagle3_draft_dir

HEADS = {"demo": demo_draft_dir, "demo-eagle3": eagle3_draft_dir}


def trained_on(training: dict):
    """``(set, index) -> bool`` from a head's ``training.json``: the prompts its training split held.

    A head with a ``split`` entry trained on every index outside % 10 in {0, 5}; an older head on every index
    outside % 10 == 0 of the sets it lists, pycode / GSM8K only up to its ``--limit``."""
    if "split" in training:
        assert "index % 10 == 5 validation" in training["split"]
        return lambda name, i: i % 10 not in (0, 5)
    limit = int(re.search(r"--limit (\d+)", training["command"]).group(1))
    sets = re.search(r"--prompts ([a-z0-9,]+)", training["command"]).group(1).split(",")
    return lambda name, i: name in sets and i % 10 != 0 and (name in ("humaneval", "mtbench") or i < limit)


@pytest.mark.parametrize("draft", sorted(HEADS))
def test_table_prompts_are_unseen_and_not_the_test_split(draft):
    d = HEADS[draft]()
    with open(os.path.join(d, "policy_table.json")) as f:
        blob = json.load(f)
    with open(os.path.join(d, "training.json")) as f:
        seen = trained_on(json.load(f))
    ids = [(p.split("/")[0], int(p.split("/")[1])) for p in blob["prompts"]]
    assert len(ids) >= 16 and len(set(ids)) == len(ids)
    assert not [p for p in ids if seen(*p)], "the table was measured on prompts the head trained on"
    assert not [p for p in ids if p[0] in ("humaneval", "mtbench") and p[1] % 10 == 0], "test split"


@pytest.mark.parametrize("draft", sorted(HEADS))
def test_table_cells_are_consistent(draft):
    d = HEADS[draft]()
    table = load_policy_table(d)
    with open(os.path.join(d, "policy_table.json")) as f:
        n_prompts = len(json.load(f)["prompts"])
    assert set(table) == {"eagle2", "talon", "salf", "c2t", "chain"}
    for name, cells in table.items():
        for budget, c in cells.items():
            n = int(budget)
            assert 1 <= c["tau"] <= n and 1 <= c["tree"] <= n + 1e-9, (name, budget)
            assert len(c["taus"]) == n_prompts and min(c["taus"]) <= c["tau"] <= max(c["taus"]), (name, budget)
