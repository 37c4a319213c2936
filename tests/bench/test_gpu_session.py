"""``bench/gpu_session.sh``: it runs the steps ``STEPS`` names, in order, each logged with its exit status, and every
benchmark it starts takes its arguments (a typo would cost a GPU session's call). ``python`` is a stand-in here that
records its arguments."""

import os
import shlex
import subprocess
import sys

import pytest

from bench import round_host_cost
from bench.plugin_round_profile import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# the stand-in python: records its arguments; a collection lists two test files; a run of a file named in $HANG
# sleeps (a test stuck on the device)
FAKE = """#!/bin/sh
printf "%s\\n" "$*" >> {calls}
printf "%s\\n" "${{PYTHONPATH:-}}" >> {calls}.path
case "$*" in *--collect-only*) [ -n "$NO_TESTS" ] && exit 5
    printf "tests/plugin/test_a.py::t[cuda]\\ntests/training/test_b.py::u\\n"; exit 0;; esac
case "$*" in *"$HANG"*) [ -n "$HANG" ] && sleep 30;; esac
echo "ran $1"
"""


def run_script(tmp_path, steps, script="bench/gpu_session.sh", wrap=(), **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    fake = bin_dir / "python"
    fake.write_text(FAKE.format(calls=shlex.quote(str(calls))))
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), STEPS=steps,
               **dict(dict(HANG="", NO_TESTS=""), **env))
    done = subprocess.run([*wrap, "bash", script], cwd=ROOT, env=env, capture_output=True, text=True)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return done, lines, (tmp_path / "out")


@pytest.mark.skipif(sys.platform == "win32", reason="a bash script")
def test_every_profile_step_parses_and_runs_in_order(tmp_path):
    done, calls, out = run_script(tmp_path, "eagle3,profile,flashinfer,firandom,bf16,host,paired,random,tests",
                                  FI_SITE="/fi-site", PYTHONPATH="/bed")
    assert done.returncode == 0, done.stderr
    paths = (tmp_path / "calls.txt.path").read_text().splitlines()[3:]  # the benchmarks' (after the GPU tests')
    # FlashInfer's site on the path of its two steps only: SGLang uses FlashInfer wherever it can import it
    assert paths == ["/bed", "/bed", "/bed", "/fi-site:/bed", "/bed", "/fi-site:/bed", "/bed", "/bed"]
    tests, calls = calls[:3], calls[3:]  # the GPU tests: a collection, then one run per file (bench/gpu_tests.sh)
    assert "--collect-only" in tests[0] and [t.split()[-5] for t in tests[1:]] == \
        ["tests/plugin/test_a.py", "tests/training/test_b.py"]
    assert [c.split()[0] for c in calls] == ["bench/round_host_cost.py"] + \
        ["bench/plugin_round_profile.py"] * 7  # the script's order
    profiles = [parse_args(c.split()[1:]) for c in calls[1:]]  # checked as the script checks: FlashInfer never float32
    assert all(a.device == "cuda" and a.bs == [1, 16, 64] and a.out.startswith(str(out)) for a in profiles)
    assert [a.target for a in profiles] == ["random", "random", "random", "demo", "demo", "demo", "demo"]
    assert [a.attention for a in profiles] == ["triton", "triton", "flashinfer", "triton", "flashinfer", "triton",
                                               "triton"]
    assert [a.paired for a in profiles] == [0, 8, 0, 0, 0, 0, 0] and "eagle2" in profiles[1].sets.split(",")
    assert profiles[2].plain and profiles[2].dtype == "bfloat16" and profiles[4].ragged == "0,1,tuned"
    assert profiles[6].draft == "demo-eagle3"
    assert round_host_cost.parser().parse_args(calls[0].split()[1:]).device == "cuda"
    status = (out / "steps.txt").read_text().splitlines()
    assert [s.split(":")[0] for s in status] == ["tests", "host", "random", "paired", "firandom", "profile",
                                                 "flashinfer", "bf16", "eagle3"]
    assert all("rc 0" in s for s in status) and (out / "profile.log").read_text().startswith("ran ")
    # every step's output also reaches the call's stdout (what returns when $OUT does not), in the steps' order
    ran = [ln for ln in done.stdout.splitlines() if ln.startswith("ran ")]
    assert ran == ["ran -m"] * 2 + [f"ran {c.split()[0]}" for c in calls]
    assert all("faulthandler_timeout=" in t and " -v " in t for t in tests[1:])  # a stuck GPU test names itself


def test_a_test_file_that_hangs_costs_its_limit_and_the_next_file_still_runs(tmp_path):
    done, calls, _ = run_script(tmp_path, "", script="bench/gpu_tests.sh", HANG="test_a.py", GPU_TEST_FILE_S="2")
    assert done.returncode == 124, done.stdout  # timeout's status, passed on
    assert "gpu tests: tests/plugin/test_a.py rc 124" in done.stdout
    assert "gpu tests: tests/training/test_b.py rc 0" in done.stdout and len(calls) == 3


def test_only_the_named_steps_run(tmp_path):
    done, calls, out = run_script(tmp_path, "bf16")
    assert done.returncode == 0 and len(calls) == 1 and "--dtype bfloat16" in calls[0]
    assert (out / "steps.txt").read_text().startswith("bf16: rc 0")


def test_the_whole_run_has_a_deadline_and_a_file_after_it_does_not_start(tmp_path):
    done, calls, _ = run_script(tmp_path, "", script="bench/gpu_tests.sh", HANG="tests/", GPU_TESTS_S="3")
    assert done.returncode == 124 and len(calls) == 2  # the collection, the first file (cut at the deadline)
    assert "gpu tests: tests/training/test_b.py not run (GPU_TESTS_S spent)" in done.stdout


def test_a_term_from_outside_stops_the_file_running(tmp_path):
    """An outer ``timeout`` reaches the script only (each file's ``timeout`` has its own process group): the script
    passes the TERM on, so the call ends at the outer limit, not at the file's."""
    import time

    t = time.time()
    done, calls, _ = run_script(tmp_path, "", script="bench/gpu_tests.sh", wrap=("timeout", "2"), HANG="test_a.py",
                                GPU_TEST_FILE_S="30")
    assert time.time() - t < 10 and done.returncode == 124 and len(calls) == 2


def test_collections_own_status_is_reported(tmp_path):
    done, calls, _ = run_script(tmp_path, "", script="bench/gpu_tests.sh", NO_TESTS="1")
    assert done.returncode == 5 and "(collection rc 5)" in done.stdout and len(calls) == 1


@pytest.mark.parametrize("dtype, ok", [("float32", False), ("bfloat16", True), ("float16", True)])
def test_flashinfer_is_refused_in_float32_before_an_engine_starts(dtype, ok, capsys):
    """FlashInfer's JIT has no float32 kernels: such a run would fail at SGLang's first forward, after the engine's
    start had spent a GPU call's minutes; Triton takes float32, and the CPU ignores ``--attention``."""
    argv = ["--device", "cuda", "--attention", "flashinfer", "--dtype", dtype]
    if ok:
        assert parse_args(argv).dtype == dtype
    else:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "--attention flashinfer needs --dtype bfloat16 or float16" in capsys.readouterr().err
    assert parse_args(["--device", "cuda", "--attention", "triton", "--dtype", dtype]).dtype == dtype
    assert parse_args(["--attention", "flashinfer", "--dtype", dtype]).device == "cpu"
