"""``bench/round_pairs.py``: native against each set in ABBA blocks, so a drift of the machine over the run does not
pass for a set's cost (the H100's native moved more within one call than the gap the issue asks to tell)."""

import math

import pytest

from bench.plugin_round_profile import parse_args
from bench.round_pairs import abba, decode_ms, differing_requests, paired, share, table


def test_every_block_serves_native_the_set_the_set_native_on_its_own_share():
    assert abba(["eagle2", "mix"], 2) == [(j, name, place) for j in (0, 1) for name in ("eagle2", "mix")
                                          for place in ("a1", "b1", "b2", "a2")]


@pytest.mark.parametrize("drift", [0.0, 0.37, -0.2])
def test_a_linear_drift_cancels_and_each_sets_own_cost_remains(drift):
    """A machine whose rounds grow by ``drift`` ms every run, whose share j costs 0.5 j ms more, and whose sets
    cost their own offset over native: each block's gap is the set's offset (to rounding), whatever the drift;
    native paired with itself gaps 0. Wall time is 10x the ms here, so its ratio is the sets' ratio."""
    own = {"native": 0.0, "eagle2": 0.05, "mix": 0.4}
    calls = []

    def run(j, name):
        ms = 4.0 + 0.5 * j + own[name] + drift * len(calls)
        calls.append((j, name))
        return ms, 10 * ms

    got = paired(run, ["native", "eagle2", "mix"], 3)
    assert calls == [(j, name) for j in range(3) for s in ("native", "eagle2", "mix")
                     for name in ("native", s, s, "native")]  # native, the set, the set, native; share j in block j
    for name, offset in own.items():
        r = got[name]
        assert r["gaps"] == pytest.approx([offset] * 3, abs=1e-9), name
        assert (r["median"], r["lo"], r["hi"]) == pytest.approx((offset, offset, offset), abs=1e-9)
        for j, (nat, mine, ratio) in enumerate(zip(r["native_ms"], r["set_ms"], r["wall_ratio"])):
            assert mine - nat == pytest.approx(offset, abs=1e-9) and ratio == pytest.approx(mine / nat)


def test_the_gaps_summary_is_the_median_and_range_over_blocks():
    gaps = [0.3, -0.1, 0.05]  # block j: the set's runs cost native's plus gaps[j], and twice its wall time

    def run(j, name):
        return (1.0, 1.0) if name == "native" else (1.0 + gaps[j], 2.0)

    r = paired(run, ["eagle2"], 3)["eagle2"]
    assert r["gaps"] == pytest.approx([0.3, -0.1, 0.05])
    assert (r["median"], r["lo"], r["hi"]) == pytest.approx((0.05, -0.1, 0.3)) and r["wall_ratio"] == [2.0] * 3
    text = table({16: {"eagle2": r}}, "auto")
    assert "| eagle2 | 3 | 1.000 | 1.050 | +0.050 (-0.100 .. +0.300) | 2.000 | - |" in text and "bs 16" in text


def test_each_sets_outputs_are_checked_against_natives_in_its_block():
    """The set's two runs against the block's first native run on the same prompts: a request whose output differs
    is named at its first differing token (once per request however many runs differ); native against itself
    differs nowhere when the engine is deterministic; a run without outputs leaves the check off."""
    base = {0: [[1, 2, 3], [4, 5, 6]], 1: [[7, 8, 9], [1, 1, 1]]}  # block -> native's outputs on its prompts

    def run(j, name):
        outs = [list(o) for o in base[j]]
        if name == "mix" and j == 1:
            outs[1][2] = 0  # request 1 of block 1 leaves native's at position 2, in both of the set's runs
        if name == "talon" and j == 0 and run.calls.count((0, "talon")) == 1:
            outs[0] = [1, 2]  # the second of its runs stops short: the length differs at position 2
        run.calls.append((j, name))
        return 1.0, 1.0, outs

    run.calls = []
    got = paired(run, ["native", "mix", "talon"], 2)
    assert got["native"]["differing"] == [[], []] and differing_requests(got["native"]) == 0
    assert got["mix"]["differing"] == [[], [("b1", 1, 2, 0, 1), ("b2", 1, 2, 0, 1)]]
    assert differing_requests(got["mix"]) == 1
    assert got["talon"]["differing"] == [[("b2", 0, 2, -1, 3)], []] and differing_requests(got["talon"]) == 1
    assert "| mix | 2 | 1.000 | 1.000 | +0.000 (+0.000 .. +0.000) | 1.000 | 1 |" in table({1: got}, "auto")
    unchecked = paired(lambda j, name: (1.0, 1.0), ["eagle2"], 1)["eagle2"]
    assert unchecked["differing"] is None and differing_requests(unchecked) is None
    assert table({1: {"eagle2": unchecked}}, "auto").splitlines()[-1].endswith("| 1.000 | - |")


def test_a_block_serves_full_batches_in_turn_through_the_prompts():
    prompts = list(range(10))
    assert share(prompts, 0, 4, 2) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert share(prompts, 1, 4, 2) == [8, 9, 0, 1, 2, 3, 4, 5]  # wraps around: every batch full at bs 4
    assert share(prompts, 3, 1, 2) == [6, 7] and len(share(prompts, 0, 64, 2)) == 128


def test_a_round_is_a_decode_round_of_either_kind():
    prof = {"ts": {"rounds": 3, "round_s": 0.012}, "native": {"rounds": 1, "round_s": 0.002},
            "prefill": {"rounds": 5, "round_s": 1.0}}
    assert decode_ms(prof) == pytest.approx(1e3 * 0.014 / 4)
    assert math.isnan(decode_ms({"prefill": {"rounds": 1, "round_s": 0.1}}))


@pytest.mark.parametrize("argv,message", [
    (["--paired", "2", "--sets", "eagle2,bogus"], "--sets takes names from ['native', 'eagle2', 'talon', 'salf', "
                                                  "'c2t', 'chain', 'eagle2-small', 'mix'], got ['bogus']"),
    (["--paired", "1001"], "--paired must be 0 (off) or in [1, 1000], got 1001"),
    (["--paired", "-1"], "--paired must be 0 (off) or in [1, 1000], got -1"),
    (["--paired", "2", "--paired-batches", "0"], "--paired-batches must be in [1, 1000], got 0"),
    (["--paired", "2", "--plain"], "--paired compares round times only: drop --plain (the sets' outputs are checked "
                                   "without it)"),
])
def test_a_paired_run_that_cannot_be_served_is_refused_before_any_engine_starts(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert f"error: {message}" in capsys.readouterr().err


def test_a_paired_run_parses_with_its_sets():
    a = parse_args(["--paired", "4", "--prompts", "64", "--sets", "native,eagle2,mix"])
    assert (a.paired, a.sets.split(",")) == (4, ["native", "eagle2", "mix"])
    assert parse_args([]).paired == 0


def test_a_paired_run_drives_one_engine_through_the_blocks(monkeypatch):
    """``run_paired`` on a stand-in engine whose profile grows with every batch served: a treespec batch's rounds
    cost 0.2 ms more than native's and every batch 0.01 ms more than the one before (a drift). Each concurrency is
    warmed with every set's policies, each run serves ``--paired-batches`` full batches, and the gaps come out
    at the treespec cost with native against itself at 0."""
    from bench import plugin_round_profile as prof
    from bench import round_pairs
    from treespec_sglang.plugin import profile

    served, state = [], {"ts": [0, 0.0], "native": [0, 0.0], "batches": 0}

    def generate(ids, sp):
        state["batches"] += 1
        kind = "ts" if any("custom_params" in p for p in sp) else "native"
        ms = 4.0 + (0.2 if kind == "ts" else 0.0) + 0.01 * state["batches"]
        state[kind][0] += 16
        state[kind][1] += 16 * ms / 1e3
        served.append((len(ids), kind, sp[0]["max_new_tokens"]))
        return [{"meta_info": {}, "output_ids": []} for _ in ids]

    monkeypatch.setattr(prof, "start", lambda a, env: (generate, lambda: None))
    monkeypatch.setattr(profile, "read_profile", lambda d: {
        k: {"rounds": state[k][0], "round_s": state[k][1], "parts": {}, "ops": {}} for k in ("ts", "native")})
    a = parse_args(["--paired", "3", "--paired-batches", "2", "--bs", "1,4", "--sets", "native,eagle2",
                    "--max-new-tokens", "16"])
    got = round_pairs.run_paired(a, [[i] for i in range(5)], "auto", {"TREESPEC_SELECT": "auto"})
    assert set(got) == {1, 4}
    for bs in (1, 4):
        assert got[bs]["native"]["gaps"] == pytest.approx([0.0] * 3, abs=1e-9)
        assert got[bs]["eagle2"]["gaps"] == pytest.approx([0.2] * 3, abs=1e-9)
    timed = [s for s in served if s[2] == 16]
    assert len(timed) == 2 * 3 * 2 * 4 * 2  # bs, blocks, sets, runs a block, batches a run
    assert {n for n, _, _ in timed} == {1, 4}  # every batch full at its concurrency
    assert any(t == 4 and k == "ts" for _, k, t in served)  # the warm-up: 4 tokens, the sets' policies
