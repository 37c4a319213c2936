"""``bench/plugin_round_profile.py --target random`` through SGLang's CPU engine: a target with random weights and
no tokenizer (ids in, ids out), every policy set's greedy outputs equal to plain's (what a GPU session can run
before the demo target's files are staged)."""

import json

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]


def test_every_set_equals_plain_on_a_random_target(tmp_path):
    pytest.importorskip("sglang")
    from bench import plugin_round_profile

    import glob
    import os
    import tempfile

    scratch = os.path.join(tempfile.gettempdir(), plugin_round_profile.RANDOM_PREFIX + "*")
    before = set(glob.glob(scratch))
    out = tmp_path / "random.json"
    plugin_round_profile.main(["--target", "random", "--bs", "2", "--prompts", "2", "--max-new-tokens", "6",
                               "--no-ops", "--plain", "--out", str(out)])
    got = json.loads(out.read_text())
    rows = got["timed"]["torch"]["2"]
    assert set(rows) >= {"native", "eagle2", "talon", "salf", "c2t", "chain", "mix", "native_again"}
    for name, row in rows.items():
        assert row["differing"] == [], name  # every request equals plain greedy
        assert row["tau"] is not None and row["tok_s"] > 0, name
    assert got["args"]["target"] == "random" and got["plain_tok_s"]["2"] > 0
    assert set(glob.glob(scratch)) == before  # the random target's weights removed
