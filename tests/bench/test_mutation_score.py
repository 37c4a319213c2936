"""``bench/mutation_score.py`` (mutmut, not in CI): the group's marker expression reaches mutmut's pytest
arguments, a group whose tests run its code in spawned ranks maps every mutated function to those tests before
the survivors run again, survivors listed as equivalent count only while their mutated line still matches, and
no earlier result passes for a run's: a mutmut run that stops early and a retest of a kept run of older code are
refused, a re-read of one names the files changed since."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import mutation_score as M  # noqa: E402


def _mutmut_section(work):
    text = open(os.path.join(work, "pyproject.toml")).read()
    return text[text.index("[tool.mutmut]"):]


@pytest.mark.parametrize("group,sglang", [("ranks", True), ("pool", False), ("standins", True)])
def test_each_group_runs_its_tests_under_its_marker_expression(tmp_path, group, sglang):
    section = _mutmut_section(M.prepare(group, str(tmp_path)))
    markers = "not gpu and not slow and not e2e" + ("" if sglang else " and not sglang")
    preload = ', "-p", "bench.mutmut_preload"' if sglang else ""  # SGLang imported once, in the fork server
    deselect = "".join(f', "--deselect", "{t}"' for t in M.DESELECT)
    assert f'"-m", "{markers}"{deselect}{preload}]' in section
    assert f"pytest_add_cli_args_test_selection = {M._toml_list(M.GROUPS[group][1])}" in section
    assert f"only_mutate = {M._toml_list(M.GROUPS[group][0])}" in section
    assert os.path.exists(tmp_path / M.GROUPS[group][0][0])  # the tracked tree copied


def test_spawned_tests_map_every_mutated_function_to_the_ranks_tests(tmp_path, monkeypatch):
    os.makedirs(tmp_path / "mutants")
    ranks_t, other_t = "tests/plugin/test_ranks.py::test_agree", "tests/plugin/test_pool.py::test_x"
    stats = {"function_hashes": {"m.x_agree": "h1", "m.x__device": "h2"},
             "tests_by_mangled_function_name": {"m.x_agree": [other_t], "other.x_f": [other_t]},
             "duration_by_test": {ranks_t: 1.0, other_t: 2.0}, "stats_time": 3.0}
    (tmp_path / "mutants" / "mutmut-stats.json").write_text(json.dumps(stats))
    monkeypatch.setattr(M, "statuses", lambda work, env: {"m.x_agree__mutmut_1": "killed",
                                                          "m.x_agree__mutmut_2": "survived",
                                                          "m.x__device__mutmut_1": "no tests",
                                                          "m.x__device__mutmut_2": "timeout"})
    again = M.spawned_tests(str(tmp_path), ["tests/plugin/test_ranks.py"], {})
    assert again == ["m.x_agree__mutmut_2", "m.x__device__mutmut_1"]
    mapped = json.loads((tmp_path / "mutants" / "mutmut-stats.json").read_text())["tests_by_mangled_function_name"]
    assert mapped == {"m.x_agree": sorted([other_t, ranks_t]), "m.x__device": [ranks_t], "other.x_f": [other_t]}


def test_an_equivalent_entry_holds_only_while_its_line_still_matches():
    diffs = {"a": "--- f\n+++ f\n-    x = 1\n+    x = 2\n", "b": "--- f\n+++ f\n-    y = 1\n+    y = 3\n", "c": ""}
    equivalent = {"a": ("x = 2", "why"), "b": ("y = 2", "why")}
    assert M.classify(["a", "b", "c"], diffs, equivalent) == (["b", "c"], ["a"], ["b"])


@pytest.mark.sglang
def test_the_preload_imports_the_module_of_every_hook_target():
    pytest.importorskip("sglang")
    from bench.mutmut_preload import preload
    from treespec_sglang.plugin.hooks import HOOKS

    done = preload()
    assert done and all(m in sys.modules for m in done)
    for target in HOOKS:  # each target is an attribute path under one of the preloaded modules
        module = max((m for m in done if target.startswith(m + ".")), key=len)
        obj = sys.modules[module]
        for name in target[len(module) + 1:].split("."):
            obj = getattr(obj, name)


def test_a_kept_run_names_the_package_files_changed_since(tmp_path):
    work = M.prepare("requests", str(tmp_path))
    assert M.changed_sources(work) == []
    (tmp_path / "treespec_sglang" / "plugin" / "config.py").write_text("# older code\n")
    (tmp_path / "treespec_sglang" / "plugin" / "round.py").unlink()
    (tmp_path / "treespec_sglang" / "gone.py").write_text("")
    os.makedirs(tmp_path / "treespec_sglang" / "__pycache__")
    (tmp_path / "treespec_sglang" / "__pycache__" / "x.pyc").write_text("")  # not a source
    assert M.changed_sources(work) == ["treespec_sglang/gone.py", "treespec_sglang/plugin/config.py",
                                       "treespec_sglang/plugin/round.py"]


def test_a_retest_of_older_code_is_refused_before_mutmut_runs(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(M, "changed_sources", lambda work: ["treespec_sglang/plugin/pool.py"])
    monkeypatch.setattr(M, "statuses", lambda *a: ran.append(a) or {})
    monkeypatch.setattr(M.subprocess, "run", lambda *a, **k: ran.append(a))
    with pytest.raises(SystemExit, match=r"older code \(treespec_sglang/plugin/pool.py changed since\)"):
        M.run_group("pool", 2, False, reuse=str(tmp_path), retest=True)
    assert ran == [] and not os.path.exists(tmp_path / "tests")  # nothing copied in, nothing run


@pytest.mark.parametrize("rc", [0, 1])
def test_a_mutmut_run_that_stops_early_is_refused(monkeypatch, rc):
    calls = []
    monkeypatch.setattr(M.subprocess, "run", lambda args, **k: calls.append((args, k["cwd"]))
                        or subprocess.CompletedProcess(args, rc))
    if rc:
        with pytest.raises(SystemExit, match="exited 1 before its mutants ran"):
            M.mutmut_run("w", {}, 2, ["a", "b"])
    else:
        assert M.mutmut_run("w", {}, 2, ["a", "b"]) is None
    assert calls == [([sys.executable, "-m", "mutmut", "run", "--max-children", "2", "a", "b"], "w")]


def test_a_reread_of_a_kept_run_says_which_files_changed_since(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(M, "changed_sources", lambda work: ["treespec_sglang/plugin/pool.py"])
    monkeypatch.setattr(M, "statuses", lambda *a: {"m.x_f__mutmut_1": "killed"})
    monkeypatch.setattr(M.subprocess, "run", lambda args, **k: subprocess.CompletedProcess(args, 0, stdout="{}"))
    (row,) = M.main(["--groups", "pool", "--reuse", str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert row["changed_since"] == ["treespec_sglang/plugin/pool.py"]
    out = capsys.readouterr().out
    assert "results of older code: changed since the kept run: treespec_sglang/plugin/pool.py" in out


def test_a_mutant_a_retest_forgot_keeps_the_status_last_reported(tmp_path, monkeypatch):
    (tmp_path / M.KEPT).write_text(json.dumps({"a": "killed", "b": "survived", "c": "killed"}))
    monkeypatch.setattr(M, "statuses", lambda work, env: {"a": "not checked", "b": "killed", "c": "survived",
                                                          "d": "not checked"})
    assert M.kept_statuses(str(tmp_path), {}) == {"a": "killed", "b": "killed", "c": "survived", "d": "not checked"}
