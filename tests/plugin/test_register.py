"""The entry point ``treespec_sglang.plugin.register``: a setting the plugin cannot start with stops the process
(SGLang's loader swallows any ``Exception``, and the server then ran without the plugin or failed its first
round), before any hook is registered; the draft worker's start checks read the same settings again, and the
test-only rank faults."""

import pytest

import treespec_sglang.plugin as plugin
from treespec_sglang.plugin import StartError, cpu, hooks, ranks
from treespec_sglang.plugin.classifiers import ENV_CLASSIFIERS
from treespec_sglang.plugin.config import ENV_POLICY_MODULES
from treespec_sglang.plugin.profile import ENV_PROFILE, ENV_PROFILE_OPS
from treespec_sglang.plugin.ranks import ENV_PERTURB, ENV_PERTURB_VERIFY
from treespec_sglang.plugin.server_hooks import check_environment
from treespec_sglang.plugin.stats import ENV_MAX_ROUNDS

BAD = [  # (variables, what the message names)
    ({ENV_POLICY_MODULES: "no_such_policy_module_xyz"}, "TREESPEC_POLICY_MODULES: cannot import"),
    ({ENV_MAX_ROUNDS: "abc"}, "TREESPEC_STATS_MAX_ROUNDS must be an integer >= 0, got 'abc'"),
    ({ENV_MAX_ROUNDS: "-1"}, "TREESPEC_STATS_MAX_ROUNDS must be an integer >= 0, got -1"),
    ({ENV_CLASSIFIERS: "[1]"}, "TREESPEC_CLASSIFIERS must be a JSON object"),
    ({ENV_CLASSIFIERS: '{"mine": "/no/such/dir/clf.pt"}'}, "/no/such/dir/clf.pt"),
    ({ENV_PROFILE: "{tmp}", ENV_PROFILE_OPS: "maybe"}, "TREESPEC_PROFILE_OPS"),
]


@pytest.fixture
def registering(monkeypatch):
    """``register()`` with the CPU stand-ins' install a no-op: the hooks' registrations, counted."""
    calls = []
    monkeypatch.setattr(cpu, "install", lambda: None)
    monkeypatch.setattr(hooks, "register_hooks", lambda: calls.append("registered"))
    return calls


def _set(monkeypatch, tmp_path, variables):
    for name, value in variables.items():
        monkeypatch.setenv(name, value.replace("{tmp}", str(tmp_path)))


@pytest.mark.parametrize("variables, names", BAD)
def test_a_bad_setting_stops_the_process_and_registers_no_hook(registering, monkeypatch, tmp_path, variables, names):
    _set(monkeypatch, tmp_path, variables)
    with pytest.raises(StartError) as err:
        plugin.register()
    assert names in str(err.value.code) and str(err.value.code).startswith("treespec-sglang cannot start: ")
    assert not isinstance(err.value, Exception)  # what SGLang's loader would catch, log and go on past
    assert registering == []


def test_good_settings_register_the_hooks_once(registering, monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_MAX_ROUNDS, "16")
    monkeypatch.setenv(ENV_PROFILE, str(tmp_path / "profile"))
    plugin.register()
    assert registering == ["registered"]


@pytest.mark.parametrize("variables, names", [b for b in BAD if ENV_MAX_ROUNDS in b[0] or ENV_CLASSIFIERS in b[0]])
def test_the_draft_workers_start_checks_read_the_stats_cap_and_classifiers_again(monkeypatch, tmp_path, variables,
                                                                               names):
    """A single rank compares no settings digest, and its rounds read both: a value set after the plugin loaded
    (``configure`` before ``sgl.Engine``) stops the draft worker's start, not a round."""
    _set(monkeypatch, tmp_path, variables)
    with pytest.raises((ValueError, OSError), match=names.replace("[", r"\[")):
        check_environment()


@pytest.mark.parametrize("name", [ENV_PERTURB, ENV_PERTURB_VERIFY])
@pytest.mark.parametrize("raw", ["one", "-1", "1.0", "\u0661"])  # the last: an Arabic-Indic one, isdigit() in Python
def test_a_test_fault_naming_no_rank_stops_the_start_naming_it(monkeypatch, name, raw):
    """Test-only switches, read every round of a TP server: a value that names no rank failed a round (an
    unnamed int() error) where it now stops the start."""
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=rf"^{name} \(test-only\) must be a rank number >= 0, got "):
        check_environment()


@pytest.mark.parametrize("raw, faulty", [("", [False, False]), ("0", [True, False]), (" 1 ", [False, True])])
def test_a_test_fault_makes_the_rank_it_names_faulty(monkeypatch, raw, faulty):
    from types import SimpleNamespace

    monkeypatch.setenv(ENV_PERTURB, raw)
    check_environment()
    assert [ranks._faulty(ENV_PERTURB, SimpleNamespace(rank_in_group=k)) for k in (0, 1)] == faulty
    assert not ranks._faulty(ENV_PERTURB, None) and not ranks._faulty(ENV_PERTURB_VERIFY, SimpleNamespace(rank_in_group=0))


@pytest.mark.sglang
def test_sglangs_own_loader_cannot_swallow_the_start_error(registering, monkeypatch):
    """Through SGLang 0.5.23's ``load_plugins``, which logs and goes on past an ``Exception``."""
    plugins = pytest.importorskip("sglang.srt.plugins")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setattr(plugins, "load_plugins_by_group",
                        lambda group, excluded_dists=None: {"treespec": (plugin.register, "treespec-sglang")})
    monkeypatch.setattr(plugins.HookRegistry, "apply_hooks", staticmethod(lambda: None))
    monkeypatch.setenv(ENV_MAX_ROUNDS, "abc")
    with pytest.raises(StartError, match="TREESPEC_STATS_MAX_ROUNDS"):
        plugins.load_plugins()
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setenv(ENV_MAX_ROUNDS, "8")
    plugins.load_plugins()
    assert registering == ["registered"]
