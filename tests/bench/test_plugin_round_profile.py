"""``bench/plugin_round_profile.py``'s comparison with plain greedy (the GPU benchmark's losslessness column)."""

from bench.plugin_round_profile import differences, policy_sets


def test_differences_name_each_request_at_its_first_differing_token():
    plain = [[5, 6, 7], [1, 2, 3, 4], [9, 9], [3]]
    got = [[5, 6, 7], [1, 2, 8, 4], [9, 9, 1], [3]]
    assert differences(got, plain) == [(1, 2, 8, 3), (2, 2, 1, -1)]  # a longer output differs where plain ended
    assert differences(plain, plain) == []
    assert differences([[4, 1]], [[5, 1]]) == [(0, 0, 4, 5)]


def test_native_runs_first_and_last_around_every_policy_and_the_mix():
    sets = policy_sets(4, 3, 8)
    names = list(sets)
    assert names[0] == "native" and names[-1] == "native_again" and sets["native_again"] == [None]
    assert {"eagle2", "talon", "salf", "c2t", "chain", "mix"} <= set(names[1:-1])


def test_one_engine_per_selection_and_ragged_setting():
    from argparse import Namespace

    from bench.plugin_round_profile import engines

    assert engines(Namespace(select="auto,torch", ragged=None)) == {  # the operator's ragged setting stays
        "auto": {"TREESPEC_SELECT": "auto"}, "torch": {"TREESPEC_SELECT": "torch"}}
    both = engines(Namespace(select="auto", ragged="0,1"))
    assert both == {"auto ragged=0": {"TREESPEC_SELECT": "auto", "TREESPEC_RAGGED_VERIFY": "0"},
                    "auto ragged=1": {"TREESPEC_SELECT": "auto", "TREESPEC_RAGGED_VERIFY": "1"}}
