"""``treespec bench-server`` end to end on the CPU: a tiny matrix (plain + EAGLE topk 4 / steps 3 / N 8;
native, talon, c2t; concurrency 1 and 2) against real ``launch_server`` processes it starts and stops. One
policy is given an out-of-range parameter: its cells fail alone (HTTP 400 per request) and the run goes on."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, checkout_env

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]

N_PROMPTS = 1  # per source: 1 HumanEval + 1 MT-bench (held-out split)


@pytest.fixture(scope="module")
def bench(demo_target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-server")
    argv = [sys.executable, "-m", "treespec_sglang", "bench-server", "--servers", "plain,eagle:4/3/8",
            "--policies", "talon,c2t,salf", "--budgets", "5", "--concurrency", "1,2", "--every", "10",
            "--num-prompts", str(N_PROMPTS), "--max-new-tokens", "16", "--out", str(out),
            "--policy-json", json.dumps({"salf": {"th": 7}})]
    env = {**checkout_env(), "TREESPEC_RAGGED_VERIFY": "1"}  # every compactable verify ragged (auto: tuned)
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1500)
    rows = [json.loads(line) for line in open(out / "results.jsonl")] if (out / "results.jsonl").exists() else []
    return proc, out, rows


def test_every_cell_has_a_row_and_the_files_exist(bench):
    proc, out, rows = bench
    assert rows, proc.stdout[-3000:] + proc.stderr[-3000:]
    # plain: 2 concurrency; eagle: (native + 3 policies at budget 5 of N 8) x 2 concurrency
    assert len(rows) == 2 + (1 + 3) * 2
    assert {r["policy"] for r in rows} == {"plain", "native", "talon(b5)", "c2t(b5)", "salf(b5)"}
    requests = [json.loads(line) for line in open(out / "requests.jsonl")]
    assert len(requests) == len(rows) * 2 * N_PROMPTS
    for name in ("policies_vs_concurrency.png", "accept_hist.png", "table.md"):
        assert (out / name).stat().st_size > 500, name
    table = (out / "table.md").read_text()
    assert table.count("\n") == len(rows) + 2 and "| eagle(k4,s3,N8) | c2t(b5) | 2 | 0 |" in table


def test_bad_cells_fail_alone_and_the_exit_code_says_so(bench):
    proc, _, rows = bench
    assert proc.returncode == 1
    for r in rows:
        if r["policy"].startswith("salf"):
            assert r["ok"] == 0 and r["errors"] == r["requests"] == 2 * N_PROMPTS
            assert any("salf.th must be" in e for e in r["error_examples"]), r["error_examples"]
        else:
            assert r["errors"] == 0 and r["ok"] == 2 * N_PROMPTS, r


def test_speculative_rows_are_lossless_and_report_their_trees(bench):
    _, _, rows = bench
    for r in rows:
        if r["policy"].startswith("salf"):
            continue
        assert r["same_output"] == 1.0, r["cell"]  # greedy == the plain server's greedy, every prompt
        assert r["output_tok_s"] > 0 and r["ttft_ms_p50"] > 0 and r["itl_ms_p50"] > 0
        if r["algorithm"] == "none":
            assert r["tau"] == 1.0 and r["verified_per_round"] == 1.0
            continue
        assert 1.0 < r["tau"] <= 4.0 and r["tau"] <= r["accept_length"] + 1e-9
        if r["policy"] == "native":
            assert r["verified_per_round"] == 8.0 and r["accept_hist"] == []
        else:
            budget = r["budget"]
            assert 1.0 <= r["mean_tree_size"] <= budget
            assert r["verified_per_round"] == pytest.approx(r["mean_tree_size"])  # ragged verify: own size
            assert sum(r["accept_hist"]) == r["rounds"] and max(r["accept_hist_values"]) <= 3
