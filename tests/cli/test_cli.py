import json
import subprocess
import sys

import pytest

from treespec_sglang.cli import build_parser, main


def test_policies_lists_every_policy_with_defaults(capsys):
    assert main(["policies", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert set(rows) == {"eagle2", "talon", "salf", "c2t", "chain", "none"} and rows["none"] == {}
    assert rows["talon"] == {"budget": 60, "topk": 10, "mu": 0.03}
    assert rows["salf"]["th"] == 0.6


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "treespec_sglang", "policies"], capture_output=True, text=True,
                         check=True).stdout
    assert "talon" in out and "mu=0.03" in out


def test_every_subpackage_is_packaged():
    """pyproject lists packages explicitly (patches/ maps to treespec_sglang.patches): none missing."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "treespec_sglang").rglob("__init__.py")
             if "shim" not in p.parts}  # plugin/cpu/shim/sgl_kernel ships as package data, never as a package
    assert found | {"treespec_sglang.patches"} == listed
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "shim/sgl_kernel/__init__.py" in data["treespec_sglang.plugin.cpu"]


@pytest.mark.parametrize("argv, message", [
    (["bench", "--policy-json", "[1, 2]"], "--policy-json must be a JSON object or a list of objects, item 0 is int"),
    (["bench", "--policy-json", "{not json"], "--policy-json is not valid JSON"),
    (["bench", "--policies", "medusa"], "--policies: unknown policy 'medusa'"),
    (["bench", "--policy-json", '{"policy": "talon", "mu": 7}'], "policy 5 (talon): talon.mu must be in"),
    (["demo", "--budget", "0"], "policy 0 (eagle2): eagle2.budget must be"),
    (["train", "c2t", "--draft", "/nonexistent-draft", "--out", "/tmp/x.pt"], "/nonexistent-draft"),
])
def test_bad_cli_input_is_one_line_and_exit_code_2(argv, message):
    out = subprocess.run([sys.executable, "-m", "treespec_sglang", *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("argv, message", [
    (["bench", "--every", "0"], "treespec bench: error: argument --every: must be an integer >= 1, got 0"),
    (["bench", "--limit", "-1"], "argument --limit: must be an integer >= 1, got -1"),  # sliced a prompt away
    (["bench-server", "--every", "x"], "argument --every: must be an integer >= 1, got 'x'"),
    (["demo", "--humaneval", "-1"], "argument --humaneval: must be an integer >= 0, got -1"),
    (["demo", "--lookup", "0"], "argument --lookup: must be an integer >= 1, got 0"),  # ran greedy, labelled k=0
    (["train", "c2t", "--every", "0"], "argument --every: must be an integer >= 1, got 0"),
    (["train", "draft", "--heldout-every", "2"], "argument --heldout-every: must be an integer >= 3, got 2"),
    (["train", "vocab", "--heldout-every", "0"], "argument --heldout-every: must be an integer >= 3, got 0"),
    (["train", "data", "--limit", "0"], "argument --limit: must be an integer >= 1, got 0"),
])
def test_a_count_out_of_range_is_one_line_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "1,x"], "--concurrency entries must be integers >= 1, got 'x'"),
    (["--concurrency", "0"], "--concurrency entries must be integers >= 1, got '0'"),
    (["--temperatures", "-1"], "--temperatures entries must be numbers >= 0.0, got '-1'"),
    (["--policy-json", '{"talon": 5}'], "--policy-json['talon'] must be a JSON object of that policy's parameters, "
                                        "got 5"),
    (["--policy-json", '{"tallon": {"mu": 0.1}}'], "--policy-json keys must be policy names"),
])
def test_bench_server_refuses_bad_lists_and_overrides_naming_the_flag(flags, message, capsys):
    """Before any server starts or any model loads (a bad override was a TypeError traceback, a typo ignored)."""
    assert main(["bench-server", "--url", "http://127.0.0.1:9", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def _command_paths(parser, prefix=()):
    """Every subcommand path of ``parser`` (``("train", "draft")``, ...), walked through argparse's tree."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield prefix + (name,)
                yield from _command_paths(child, prefix + (name,))


def test_the_command_walk_finds_nested_subcommands():
    paths = set(_command_paths(build_parser()))
    assert {("demo",), ("bench",), ("train",), ("train", "draft"), ("train", "c2t")} <= paths


@pytest.mark.parametrize("path", sorted(_command_paths(build_parser())), ids="-".join)
def test_every_subcommand_help_prints(path, capsys):
    """``--help`` of every subcommand renders (an unescaped ``%`` in a help string makes argparse raise)."""
    with pytest.raises(SystemExit) as e:
        main([*path, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: treespec " + " ".join(path)) and "--" in out


def test_informational_lines_go_to_stdout(tmp_path, capsys, monkeypatch):
    """The dtype line (printed before any error can happen) is on stdout, so stderr holds only the error."""
    from tests.models.tiny import make_tiny_llama

    make_tiny_llama(tmp_path)
    capsys.readouterr()  # transformers' own save progress
    rc = main(["train", "c2t", "--target", str(tmp_path), "--draft", "random", "--dtype", "float32",
               "--samples", str(tmp_path / "missing.pt"), "--prompts", "no-such-set", "--out", str(tmp_path / "c.pt")])
    cap = capsys.readouterr()
    assert rc == 2 and "dtype float32 (asked for)" in cap.out
    assert len(cap.err.strip().splitlines()) == 1 and "dtype" not in cap.err, cap.err


def test_debug_shows_the_traceback():
    out = subprocess.run([sys.executable, "-m", "treespec_sglang", "--debug", "bench", "--policy-json", "[1]"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "Traceback" in out.stderr and "ValueError" in out.stderr


def test_a_failed_cell_says_why_in_the_table():
    from types import SimpleNamespace

    from treespec_sglang.engine.runs import PolicyRun, failed_requests, format_table

    ok = SimpleNamespace(token_ids=[1, 2], error=None, stats=SimpleNamespace(accepted=[1], draft_forwards=2,
                                                                           tree_sizes=[3]))
    bad = SimpleNamespace(token_ids=[], error="request 1: classifier: no such file", stats=SimpleNamespace(
        accepted=[], draft_forwards=0, tree_sizes=[]))
    runs = [PolicyRun(None, 1.0, [ok, ok]), PolicyRun({"policy": "c2t", "budget": 8}, 1.0, [ok, bad])]
    table = format_table(runs, 0.0).splitlines()
    assert "FAILED 1/2: request 1: classifier: no such file" in table[-1]
    assert failed_requests(runs) == 1 and failed_requests(runs[:1]) == 0


def test_plan_vs_measured_rows_and_the_plain_sentences():
    """Each planned policy's row puts the plan beside the run (tau error relative to the plan), and the demo
    says so plainly when no plan expected to beat plain decoding and when no run did."""
    from types import SimpleNamespace

    from treespec_sglang.engine.runs import PolicyRun, plan_vs_measured
    from treespec_sglang.engine.cost import BudgetChoice

    def run(spec, seconds, accepted, decode=None):
        stats = SimpleNamespace(accepted=accepted, draft_forwards=len(accepted))
        return PolicyRun(spec, seconds, [SimpleNamespace(token_ids=[0] * 12, stats=stats)], decode)

    plain = run(None, 1.0, [], 0.88)  # 11 decode tokens (the first is the prefill's) in .88 s: 12.5 tok/s
    talon = run({"policy": "talon", "budget": 8}, 0.5, [1, 2, 1, 0], 0.275)  # tau 2.0, 2.0x; decode 40 tok/s, 3.2x
    chain = run({"policy": "chain", "length": 3}, 2.0, [0, 1])  # tau 1.5, 0.5x; decode not timed
    plans = {"talon": BudgetChoice("talon", 8, 2.5, 3.0, 1.6), "chain": BudgetChoice("chain", 4, 1.5, 2.0, 0.9)}
    lines = plan_vs_measured([plain, talon, chain], plans)
    assert lines[0].endswith("| planned speedup | measured: decode rounds | end to end |")
    assert lines[2].split(" | ")[1:] == ["2.50", "2.00", "-20%", "1.60x", "3.20x", "2.00x |"]
    assert lines[3].split(" | ")[1:] == ["1.50", "1.50", "+0%", "0.90x", "-", "0.50x |"]
    assert len(lines) == 4  # a plan above 1x and a run above plain: no sentence
    slow = {k: BudgetChoice(c.policy, c.budget, c.tau, c.round_ms, 0.8) for k, c in plans.items()}
    lines = plan_vs_measured([plain, run(talon.spec, 2.0, [1]), chain], slow)
    assert lines[-2].startswith("no policy was expected to beat plain decoding on this machine (best plan: talon")
    assert lines[-1] == "no policy beat plain decoding in this run"
    assert plan_vs_measured([plain, talon], {}) == []


def test_run_policy_times_decode_rounds_apart_from_each_batchs_prefill(monkeypatch):
    """A fake engine on a virtual clock: each batch's prefill takes 1.0 s and emits each request's first
    token (the engine's first ``progress`` call), then rounds of 0.25 s. Wall time counts both; the decode
    time starts at each batch's first call."""
    from types import SimpleNamespace

    import treespec_sglang.engine.runs as R

    clock = [0.0]
    monkeypatch.setattr(R, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    updates = []

    class Engine:
        def generate(self, chunk, max_new_tokens, policy, temperature, seed, progress):
            clock[0] += 1.0  # prefill
            progress(len(chunk))
            for _ in range(3):  # three rounds of two tokens per request
                clock[0] += 0.25
                progress(2 * len(chunk))
            return [SimpleNamespace(token_ids=[7] * 7) for _ in chunk]

    bar = SimpleNamespace(update=updates.append)
    run = R.run_policy(Engine(), [[1], [2], [3]], None, max_new_tokens=7, batch_size=2, bar=bar)
    assert run.seconds == pytest.approx(2 * (1.0 + 0.75)) and run.decode_seconds == pytest.approx(2 * 0.75)
    assert run.decode_tokens_per_s == pytest.approx((21 - 3) / 1.5) and run.tokens_per_s == pytest.approx(21 / 3.5)
    assert updates == [2, 4, 4, 4, 1, 2, 2, 2]  # the progress bar still sees every call
