import re

import pytest

from treespec_sglang.policies import parse_spec, parse_specs


@pytest.mark.parametrize("spec,match", [
    ({"policy": "medusa"}, r"policy must be one of \['c2t', 'chain', 'eagle2', 'none', 'salf', 'talon'\]"),
    ({"budget": 60}, "policy must be one of"),
    ({"policy": ["talon"]}, "policy must be one of"),  # found by the fuzzer: was a TypeError (unhashable)
    ("talon", "policy spec must be a dict"),
    ({"policy": "talon", "mu": 1.5}, r"talon.mu must be in \[0.0, 1.0\], got 1.5"),
    ({"policy": "talon", "mu": float("nan")}, r"talon.mu must be in \[0.0, 1.0\]"),
    ({"policy": "talon", "budget": "60"}, r"talon.budget must be an integer in \[1, 1024\]"),
    ({"policy": "talon", "budget": True}, r"talon.budget must be an integer"),
    ({"policy": "talon", "budget": 0}, r"talon.budget must be in \[1, 1024\], got 0"),
    ({"policy": "talon", "depth": 6}, r"talon: unknown parameter\(s\) \['depth'\]"),
    ({"policy": "eagle2", "topk": 0}, r"eagle2.topk must be in \[1, 64\]"),
    ({"policy": "eagle2", "topk": 1, "depth": 6, "budget": 60}, r"eagle2.budget must be in \[1, 7\]"),
    ({"policy": "salf", "th": -0.1}, r"salf.th must be in \[0.0, 1.0\]"),
    ({"policy": "salf", "batch": 0}, r"salf.batch must be in \[1, 60\]"),
    ({"policy": "salf", "max_depth": 0}, r"salf.max_depth must be in \[1, 64\]"),
    ({"policy": "c2t", "beta": 2}, r"c2t.beta must be in \[0.0, 1.0\]"),
    ({"policy": "c2t", "classifier": 3}, r"c2t.classifier must be a file path or a C2TClassifier"),
    ({"policy": "chain", "length": -1}, r"chain.length must be in \[0, 64\]"),
    ({"policy": "chain", "classifier": "x.pt"}, r"chain.classifier needs chain.beta"),
    # an int too large for a float: was an OverflowError (no field, no range; it failed a whole batch request)
    ({"policy": "talon", "mu": 10 ** 400}, r"talon.mu must be in \[0.0, 1.0\], got 1000000000\.\.\.0{11}$"),
    ({"policy": "salf", "th": -10 ** 400}, r"salf.th must be in \[0.0, 1.0\], got -100000000\.\.\.0{11}$"),
    ({"policy": "talon", "budget": "9" * 5000}, r"talon.budget must be an integer in \[1, 1024\], got '9{17}\.\.\.9{18}'$"),
    ({"policy": "x" * 5000}, r"policy must be one of .*, got 'x{17}\.\.\.x{18}'$"),  # a client's value, cut short
    ({"policy": "talon", 1: 2, "x": 3}, r"talon: unknown parameter\(s\) \['x', 1\]"),  # was a TypeError (sorting)
])
def test_bad_specs_name_field_and_range(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


def test_defaults_are_the_papers():
    t = parse_spec({"policy": "talon"})
    assert (t.budget, t.topk, t.mu) == (60, 10, 0.03)
    e = parse_spec({"policy": "eagle2"})
    assert (e.budget, e.topk, e.depth) == (60, 10, 6)
    s = parse_spec({"policy": "salf"})
    assert (s.budget, s.batch, s.th) == (60, 10, 0.6)
    c = parse_spec({"policy": "c2t"})
    assert (c.budget, c.topk, c.beta, c.max_depth) == (60, 10, 0.5, 10)


def test_batch_error_names_the_request():
    with pytest.raises(ValueError, match=r"request 1: salf.th"):
        parse_specs([{"policy": "talon"}, {"policy": "salf", "th": 3.0}])


def test_salf_default_batch_adapts_to_a_small_budget():
    """An unset batch follows the caller's budget (a server with 8 draft tokens); a set one is checked."""
    assert parse_spec({"policy": "salf", "budget": 8}).batch == 8
    assert parse_spec({"policy": "salf", "budget": 60}).batch == 10
    assert parse_spec({"policy": "salf", "budget": 8, "batch": 3}).batch == 3
    with pytest.raises(ValueError, match=r"salf.batch must be in \[1, 8\], got 10"):
        parse_spec({"policy": "salf", "budget": 8, "batch": 10})


# every range check's full message, one per (policy, field): "<policy>.<field> must be in [lo, hi], got v"
@pytest.mark.parametrize("spec, message", [
    ({"policy": "eagle2", "depth": 0}, "eagle2.depth must be in [1, 64], got 0"),
    ({"policy": "eagle2", "depth": 65}, "eagle2.depth must be in [1, 64], got 65"),
    # the budget's cap is EAGLE-2's tree capacity 1 + K + (depth - 1) K^2: 1 + 2 + 1 * 4 = 7
    ({"policy": "eagle2", "topk": 2, "depth": 2, "budget": 8}, "eagle2.budget must be in [1, 7], got 8"),
    ({"policy": "eagle2", "topk": 3, "depth": 3, "budget": 23}, "eagle2.budget must be in [1, 22], got 23"),
    ({"policy": "talon", "topk": 65}, "talon.topk must be in [1, 64], got 65"),
    ({"policy": "salf", "budget": 1025}, "salf.budget must be in [1, 1024], got 1025"),
    ({"policy": "salf", "budget": 1, "batch": 2}, "salf.batch must be in [1, 1], got 2"),
    ({"policy": "c2t", "budget": 0}, "c2t.budget must be in [1, 1024], got 0"),
    ({"policy": "c2t", "topk": 0}, "c2t.topk must be in [1, 64], got 0"),
    ({"policy": "c2t", "max_depth": 65}, "c2t.max_depth must be in [1, 64], got 65"),
    ({"policy": "chain", "beta": 1.5}, "chain.beta must be in [0.0, 1.0], got 1.5"),
    ({"policy": "chain", "beta": -0.5}, "chain.beta must be in [0.0, 1.0], got -0.5"),
    ({"policy": "chain", "classifier": "x.pt"},
     "chain.classifier needs chain.beta in [0.0, 1.0] (the early-stop threshold)"),
    ({"policy": "talon", "mu": True}, "talon.mu must be a number in [0.0, 1.0], got True"),
    ({"policy": "talon", "mu": "0.5"}, "talon.mu must be a number in [0.0, 1.0], got '0.5'"),
    ({"policy": "c2t", "classifier": 3}, "c2t.classifier must be a file path or a C2TClassifier module, got int"),
    ({"policy": "chain", "beta": 0.5, "classifier": 2.5},
     "chain.classifier must be a file path or a C2TClassifier module, got float"),
])
def test_each_range_error_is_the_full_message(spec, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_spec(spec)


@pytest.mark.parametrize("policy", ["c2t", "chain"])
def test_a_missing_classifier_file_fails_the_request_that_names_it(policy, tmp_path):
    path = str(tmp_path / "missing.pt")
    message = f"{policy}.classifier: file {path!r} does not exist (save one with C2TClassifier.save)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_spec({"policy": policy, "beta": 0.5, "classifier": path})


def test_the_largest_budgets_in_range_pass():
    """Upper bounds are inclusive: EAGLE-2's capacity at topk 3, depth 3 (22), SALF's batch at budget 1."""
    assert parse_spec({"policy": "eagle2", "topk": 3, "depth": 3, "budget": 22}).budget == 22
    assert parse_spec({"policy": "salf", "budget": 1, "batch": 1}).batch == 1
    assert parse_spec({"policy": "chain", "beta": 1.0}).beta == 1.0
