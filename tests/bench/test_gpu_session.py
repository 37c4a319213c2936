"""``bench/gpu_session.sh``: it runs the steps ``STEPS`` names, in order, each logged with its exit status, and every
benchmark it starts takes its arguments (a typo would cost a GPU session's call). ``python`` is a stand-in here that
records its arguments."""

import os
import shlex
import subprocess
import sys

import pytest

from bench import round_host_cost
from bench.plugin_round_profile import parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(tmp_path, steps):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    fake = bin_dir / "python"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {shlex.quote(str(calls))}\necho "ran $1"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), STEPS=steps)
    done = subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return done, lines, (tmp_path / "out")


@pytest.mark.skipif(sys.platform == "win32", reason="a bash script")
def test_every_profile_step_parses_and_runs_in_order(tmp_path):
    done, calls, out = run_script(tmp_path, "eagle3,profile,flashinfer,bf16,host,tests")
    assert done.returncode == 0, done.stderr
    assert [c.split()[0] for c in calls] == ["-m", "bench/round_host_cost.py"] + \
        ["bench/plugin_round_profile.py"] * 4  # the script's order
    for c in calls[2:]:
        a = parser().parse_args(c.split()[1:])
        assert a.device == "cuda" and a.bs == [1, 16, 64] and a.out.startswith(str(out))
    assert "--ragged 0,1" in calls[3] and "--attention flashinfer" in calls[3] and "--draft demo-eagle3" in calls[5]
    assert round_host_cost.parser().parse_args(calls[1].split()[1:]).device == "cuda"
    status = (out / "steps.txt").read_text().splitlines()
    assert [s.split(":")[0] for s in status] == ["tests", "host", "profile", "flashinfer", "bf16", "eagle3"]
    assert all("rc 0" in s for s in status) and (out / "profile.log").read_text().startswith("ran ")
    # every step's output also reaches the call's stdout (what returns when $OUT does not), in the steps' order
    assert [ln for ln in done.stdout.splitlines() if ln.startswith("ran ")] == [f"ran {c.split()[0]}" for c in calls]
    assert "faulthandler_timeout=" in calls[0] and " -v " in f" {calls[0]} "  # a stuck GPU test names itself


def test_only_the_named_steps_run(tmp_path):
    done, calls, out = run_script(tmp_path, "bf16")
    assert done.returncode == 0 and len(calls) == 1 and "--dtype bfloat16" in calls[0]
    assert (out / "steps.txt").read_text().startswith("bf16: rc 0")
