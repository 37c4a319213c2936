"""``treespec train draft``'s inputs checked before anything trains: ``--config`` (its keys and values parsed as the
flags are, the command line winning), ``--eval-policy`` (a bad one measured tau 1.0 for a whole run), and the head
against ``--arch``, ``--token-map`` and the states in ``--data``."""

import json
from types import SimpleNamespace

import pytest

from treespec_sglang.cli import build_parser, main
from treespec_sglang.cli.train import _apply_config, _check_head
from treespec_sglang.models import Eagle3DraftHead


def draft_args(*argv):
    return build_parser().parse_args(["train", "draft", *argv])


def config(tmp_path, values):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(values))
    return str(path)


def test_a_config_sets_the_flags_it_names_parsed_as_they_are(tmp_path):
    a = draft_args()
    _apply_config(a, config(tmp_path, {"lr": "1e-3", "--steps": 7, "heldout-every": 5, "loss": "talf",
                                       "resume": True, "token_map": None}))
    assert (a.lr, a.steps, a.heldout_every, a.loss, a.resume, a.token_map) == (1e-3, 7, 5, "talf", True, None)


def test_a_flag_given_on_the_command_line_wins_over_the_config(tmp_path):
    a = draft_args("--steps", "9")
    _apply_config(a, config(tmp_path, {"steps": 7, "lr": 0.01}))
    assert (a.steps, a.lr) == (9, 0.01)


@pytest.mark.parametrize("values, message", [
    ({"stepz": 1}, "unknown key 'stepz'; allowed: ["),  # a typo was ignored
    ({"steps": 0}, "steps: must be an integer >= 1, got 0"),
    ({"steps": 1.5}, "steps: must be an integer >= 1, got '1.5'"),
    ({"lr": "fast"}, "lr: could not convert string to float"),  # was a TypeError mid-run
    ({"loss": "mse"}, "loss must be one of ['kl', 'lk-alpha', 'lk-lambda', 'talf'], got 'mse'"),
    ({"resume": "yes"}, "resume must be true or false"),
    ({"steps": [1]}, "steps must be a integer >= 1, got [1]"),
    ({"fn": "x"}, "unknown key 'fn'"),  # nothing but the flags
])
def test_a_bad_config_key_or_value_is_refused_naming_both(tmp_path, values, message):
    path = config(tmp_path, values)
    with pytest.raises(ValueError) as e:
        _apply_config(draft_args(), path)
    assert str(e.value).startswith(f"--config {path}: ") and message in str(e.value), str(e.value)


def test_a_config_that_is_not_an_object_is_refused(tmp_path):
    with pytest.raises(ValueError, match="must be a JSON object of train draft's flags, got list"):
        _apply_config(draft_args(), config(tmp_path, [1]))


@pytest.mark.parametrize("policy, message", [('{"policy": "talon", "mu": 7}', "--eval-policy: talon.mu must be in"),
                                             ('{"policy": "talonx"}', "--eval-policy: policy must be one of")])
def test_a_bad_eval_policy_stops_before_any_model_loads(policy, message, capsys):
    assert main(["train", "draft", "--eval-policy", policy, "--target", "/nonexistent-target"]) == 2
    err = capsys.readouterr().err
    assert message in err and "nonexistent" not in err  # refused before the target was looked for


def data_dir(tmp_path, layers):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    man = {"format": "treespec-distill-v1", "done": [], "shards": [], "tokens": 0, "answer_tokens": 0}
    if layers is not None:
        man["aux_layers"] = layers
    (d / "manifest.json").write_text(json.dumps(man))
    return str(d)


def eagle3_head(layers):
    head = Eagle3DraftHead.__new__(Eagle3DraftHead)  # the attributes _check_head reads, no weights
    head.aux_layers = layers
    return head


@pytest.mark.parametrize("arch, init, token_map, head, layers, message", [
    ("eagle3", "eagle-dir", None, "eagle", None, "--arch eagle3 with --init eagle-dir: that head is an EAGLE head"),
    ("eagle", "e3-dir", "map.pt", (2, 15, 27), [2, 15, 27], "--token-map with --init e3-dir: an EAGLE-3 head carries"),
    ("eagle", None, None, "eagle", [2, 15, 27], "holds states of target layers [2, 15, 27]; this head needs plain"),
    ("eagle3", None, "map.pt", (2, 15, 27), None, "holds states of target layers none (plain); this head needs "
                                                  "EAGLE-3 states of target layers [2, 15, 27]"),
    ("eagle3", None, "map.pt", (2, 15, 27), [2, 14, 27], "this head needs EAGLE-3 states of target layers [2, 15, 27]"),
])
def test_a_head_that_does_not_fit_its_flags_or_data_is_refused(tmp_path, arch, init, token_map, head, layers,
                                                               message):
    a = SimpleNamespace(arch=arch, init=init, token_map=token_map, data=data_dir(tmp_path, layers))
    with pytest.raises(ValueError) as e:
        _check_head(a, object() if head == "eagle" else eagle3_head(head))
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("arch, head, layers", [("eagle", "eagle", None), ("eagle", "eagle", []),
                                                ("eagle3", (2, 15, 27), [2, 15, 27]),
                                                ("eagle", (2, 15, 27), [2, 15, 27])])  # an EAGLE-3 --init
def test_a_head_that_fits_passes(tmp_path, arch, head, layers):
    a = SimpleNamespace(arch=arch, init="dir" if arch == "eagle" and head != "eagle" else None, token_map=None,
                        data=data_dir(tmp_path, layers))
    _check_head(a, object() if head == "eagle" else eagle3_head(head))
