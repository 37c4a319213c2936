"""The server's classifier registry: names from the operator, never paths from a client."""

import json
import os

import pytest
import torch

import treespec_sglang.plugin.classifiers as C
from treespec_sglang.plugin.request import diagnose, request_params
from treespec_sglang.plugin.config import ServerDefaults, configure
from treespec_sglang.policies.classifier import C2TClassifier


@pytest.fixture
def fast(tmp_path):
    path = tmp_path / "fast.pt"
    m = C2TClassifier(hidden=8)
    m.save(str(path))
    return str(path), m


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in (C.ENV_CLASSIFIERS, "TREESPEC_POLICY", "TREESPEC_CONFIG", "TREESPEC_TOKEN_CAP"):
        monkeypatch.delenv(k, raising=False)
    yield
    configure(None, classifiers={})


def test_flags_parse_to_absolute_files(fast, tmp_path, monkeypatch):
    path, _ = fast
    monkeypatch.chdir(tmp_path)
    assert C.parse_classifier_flags(["fast=fast.pt"]) == {"fast": path}
    for bad, msg in [(["fast"], "must be NAME=PATH"), (["=x.pt"], "must be NAME=PATH"),
                     (["a/b=fast.pt"], "a name is 1-64 characters"), (["f=missing.pt"], "is not a file"),
                     (["f=fast.pt", "f=fast.pt"], "given twice")]:
        with pytest.raises(ValueError, match=msg):
            C.parse_classifier_flags(bad)


def test_registry_loads_each_file_once_and_hashes_it(fast, monkeypatch):
    import hashlib

    path, m = fast
    monkeypatch.setenv(C.ENV_CLASSIFIERS, json.dumps({"fast": path}))
    reg = C.registered()
    assert set(reg) == {"default", "fast"} and C.registered()["fast"] is reg["fast"]
    x = torch.rand(5, 3)
    assert torch.equal(reg["fast"](x), m(x))
    assert C.classifier_digests()["fast"] == hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("value", ["/etc/hostname", "/proc/self/environ", "/nonexistent/x.pt", "../fast.pt", 3, ""])
def test_a_request_never_names_a_file(fast, monkeypatch, value):
    """Whatever the value (an existing file, a missing one, not a string), the message is the same and no
    file is opened."""
    path, _ = fast
    monkeypatch.setenv(C.ENV_CLASSIFIERS, json.dumps({"fast": path}))
    C.registered()
    opened = []
    real_open = open

    def spy(f, *a, **k):
        opened.append(f)
        return real_open(f, *a, **k)

    monkeypatch.setattr("builtins.open", spy)
    monkeypatch.setattr(torch, "load", lambda *a, **k: opened.append(a) or {})
    msg = diagnose({"treespec": {"policy": "c2t", "classifier": value}})
    assert msg == ("custom_params['treespec']: c2t.classifier must be one of the server's registered classifiers "
                   "['default', 'fast'], got a value that is not a classifier name (paths are never opened)")
    assert opened == []


@pytest.mark.parametrize("policy, allowed", [("talon", ["budget", "topk", "mu"]), ("eagle2", ["budget", "topk", "depth"]),
                                             ("salf", ["budget", "batch", "th", "max_depth"]), ("none", [])])
@pytest.mark.parametrize("value", ["default", "/etc/hostname"])
def test_a_classifier_on_a_policy_without_one_is_an_unknown_parameter(policy, allowed, value):
    """Not a registered-names message (its advice, a registered name, would then fail as unknown): the same
    message whatever the value."""
    msg = diagnose({"treespec": {"policy": policy, "classifier": value}})
    assert msg == (f"custom_params['treespec']: {policy}: unknown parameter(s) ['classifier']; allowed: {allowed}")


def test_a_registered_name_resolves_to_the_loaded_module(fast, monkeypatch):
    path, _ = fast
    monkeypatch.setenv(C.ENV_CLASSIFIERS, json.dumps({"fast": path}))
    sp = type("SP", (), {"custom_params": {"treespec": {"policy": "chain", "length": 3, "beta": 0.4,
                                                        "classifier": "fast"}}})()
    p = request_params(sp, ServerDefaults())
    assert p.classifier is C.registered()["fast"]
    assert "got 'fsat'" in diagnose({"treespec": {"policy": "c2t", "classifier": "fsat"}})


def test_the_server_default_may_name_a_registered_classifier(fast):
    path, _ = fast
    d = configure("c2t", {"budget": 8, "classifier": "fast"}, classifiers={"fast": path})
    assert json.loads(os.environ[C.ENV_CLASSIFIERS]) == {"fast": path}
    p = request_params(type("SP", (), {"custom_params": None})(), d)
    assert p.classifier is C.registered()["fast"]
    with pytest.raises(ValueError, match="registered classifiers"):
        configure("c2t", {"classifier": path})  # a path, even the operator's, is not a name
    with pytest.raises(ValueError, match="is not a file"):
        configure(None, classifiers={"x": path + ".missing"})
    configure(None, classifiers={"fast": path})
    configure("talon")  # classifiers=None: the registry stays
    assert set(C.registered()) == {"default", "fast"}
    configure(None, classifiers={})  # {}: cleared
    assert set(C.registered()) == {"default"}


def test_a_damaged_registered_file_fails_the_start(tmp_path, monkeypatch):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a classifier")
    with pytest.raises(ValueError, match="--treespec-classifier bad: .*not a treespec C2T classifier"):
        configure(None, classifiers={"bad": str(bad)})


def test_names_are_1_to_64_allowed_characters_from_a_flag_or_the_environment(fast):
    path, _ = fast
    assert C.parse_classifier_flags(["a" * 64 + "=" + path]) == {"a" * 64: path}
    for bad in ("a" * 65, "a b", "é"):
        with pytest.raises(ValueError) as e:
            C.parse_classifier_flags([f"{bad}={path}"])
        assert str(e.value) == ("--treespec-classifier: a name is 1-64 characters of letters, digits, '_', '-', "
                                f"'.', got {bad!r}")
    for bad in ("", "a" * 65):  # TREESPEC_CLASSIFIERS set by hand is held to the same rule
        with pytest.raises(ValueError, match=f"a name is 1-64 characters .*, got {bad!r}"):
            C.load_registry(json.dumps({bad: path}))


def test_a_flag_splits_at_its_first_equals_sign(fast, tmp_path):
    path, m = fast
    odd = tmp_path / "c2t=v2.pt"  # a path may hold '=': the name is what comes before the first one
    m.save(str(odd))
    assert C.parse_classifier_flags([f"fast={odd}"]) == {"fast": str(odd)}
    for bad in ("fast=", "=", "fast"):
        with pytest.raises(ValueError) as e:
            C.parse_classifier_flags([bad])
        assert str(e.value) == f"--treespec-classifier must be NAME=PATH, got {bad!r}"


def test_a_request_resolves_against_the_given_registry_and_echoes_only_name_like_values(fast):
    _, m = fast
    assert C.resolve_request_classifier({"policy": "c2t", "classifier": "mine"}, {"mine": m})["classifier"] is m
    spec = {"policy": "nope", "classifier": "/etc/passwd"}  # an unknown policy: parse_spec refuses it by its name
    assert C.resolve_request_classifier(spec, {"mine": m}) is spec
    hidden = "a value that is not a classifier name (paths are never opened)"
    for name, shown in [("a", "'a'"), ("b" * 64, repr("b" * 64)), ("b" * 65, hidden), ("", hidden),
                        ("../x.pt", hidden), (3, hidden)]:
        with pytest.raises(ValueError) as e:
            C.resolve_request_classifier({"policy": "c2t", "classifier": name}, {"mine": m})
        assert str(e.value) == f"c2t.classifier must be one of the server's registered classifiers ['mine'], got {shown}"
