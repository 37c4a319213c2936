"""``bench/gpu_calls.py``: the next GPU session's calls keep to the device tool's limits (what a refused or broken
call would cost is the session's device time), and their sizes count what a call sends: the checkout's tracked and
untracked-not-ignored files plus the carried folders, never an ignored folder left behind."""

import os
import re
import subprocess

import pytest

from bench import gpu_calls
from bench.gpu_calls import (CALLS, LIMIT_BYTES, SESSION_SCRIPT, SETUP_S, STEP_GRACE_S, Call, call_sizes, main,
                              step_limits, worst_case_s)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _steps_defined() -> set:
    with open(os.path.join(ROOT, "bench", "gpu_session.sh")) as f:
        return set(re.findall(r"^step (\w+) ", f.read(), flags=re.M))


def test_the_step_limits_are_gpu_sessions_own(tmp_path):
    script = tmp_path / "s.sh"
    script.write_text("step tests 330 env X=1 bash t.sh\n# step gone 5 x\nstep host 90 python h.py\n")
    assert step_limits(str(script)) == {"tests": 330, "host": 90}
    assert set(step_limits(SESSION_SCRIPT)) == _steps_defined()


def test_no_call_of_the_plan_can_be_outlasted_by_its_own_steps():
    """A call's steps at their limits (each with the script's 20 s kill grace) and its own set-up fit its timeout:
    otherwise the call's end would kill its last step and lose that step's results."""
    limits = step_limits(SESSION_SCRIPT)
    for call in CALLS:
        assert worst_case_s(call, limits) <= call.timeout_s, call.name
    call = Call("c", ("gpu/tools",), "STEPS=tests,host bash bench/gpu_session.sh", 600)
    assert worst_case_s(call, {"tests": 100, "host": 50}) == SETUP_S + 100 + 50 + 2 * STEP_GRACE_S
    with pytest.raises(KeyError):
        worst_case_s(call, {"tests": 100})


def test_a_call_its_steps_could_outlast_is_named_and_fails(tmp_path, capsys):
    repo = _repo(tmp_path)
    limits = step_limits(SESSION_SCRIPT)
    need = worst_case_s(Call("p", ("gpu/a",), "STEPS=paired x", 600), limits)
    assert main([], repo=str(repo), calls=[Call("p", ("gpu/a",), "STEPS=paired x", need)]) == 0
    assert main([], repo=str(repo), calls=[Call("p", ("gpu/a",), "STEPS=paired x", need - 1)]) == 1
    out, err = capsys.readouterr()
    assert f"call 'p': its steps at their limits take {need} s, over its timeout_s {need - 1}" in err
    assert "ITS STEPS OUTLAST IT" in out


def test_every_step_a_call_names_is_one_gpu_session_runs():
    defined = _steps_defined()
    named = [s for c in CALLS for m in re.findall(r"STEPS=([\w,]+)", c.command) for s in m.split(",")]
    assert named and set(named) <= defined, set(named) - defined
    assert len(named) == len(set(named))  # no step twice: a session's minutes are spent once


def test_each_flashinfer_piece_rides_once_and_is_installed_where_it_rides_before_flashinfer_runs():
    pieces = [(i, p) for i, c in enumerate(CALLS) for p in c.carry if re.fullmatch(r"gpu/fi\d+", p)]
    assert sorted(p for _, p in pieces) == ["gpu/fi1", "gpu/fi2"]
    for i, _ in pieces:
        assert "bench/gpu_flashinfer.sh install" in CALLS[i].command, CALLS[i].name
        # a piece still missing makes the install exit 2: the call's other commands must not hang on it
        assert "gpu_flashinfer.sh install &&" not in CALLS[i].command, CALLS[i].name
    uses = [i for i, c in enumerate(CALLS) if re.search(r"STEPS=\S*(fi,|firandom|flashinfer)", c.command)]
    assert uses and min(uses) > max(i for i, _ in pieces)


def test_the_stack_halves_ride_in_the_first_two_calls():
    assert "gpu/s1" in CALLS[0].carry and "gpu/s2" in CALLS[1].carry
    assert all("gpu/tools" in c.carry for c in CALLS)  # setup.sh lives there


@pytest.mark.parametrize("kw, message", [
    (dict(carry=tuple(f"gpu/p{i}" for i in range(9))), r"carry names 1 to 8 paths, got 9"),
    (dict(carry=()), r"carry names 1 to 8 paths, got 0"),
    (dict(command="x" * 2001), r"command must be 1 to 2000 characters, got 2001"),
    (dict(timeout_s=601), r"timeout_s must be in \[1, 600\], got 601"),
    (dict(timeout_s=0), r"timeout_s must be in \[1, 600\], got 0"),
])
def test_a_call_outside_the_device_tools_limits_is_refused(kw, message):
    args = dict(name="c", carry=("gpu/tools",), command="true", timeout_s=60) | kw
    with pytest.raises(ValueError, match=rf"^Call 'c': {message}$"):
        Call(**args)


def test_a_call_at_the_device_tools_limits_is_allowed():
    assert Call("c", ("a",) * 8, "x" * 2000, 600).timeout_s == 600
    assert Call("c", ("a",), "x", 1).carry == ("a",)


def _repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    run = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (repo / ".gitignore").write_text("/gpu/\n")
    (repo / "tracked.bin").write_bytes(b"t" * 1000)
    run("add", ".gitignore", "tracked.bin")
    (repo / "new.txt").write_bytes(b"n" * 300)  # untracked, not ignored: it travels too
    for name, size in [("a", 4000), ("b", 2000), ("left", 10 ** 6)]:  # ignored: only what a call carries travels
        d = repo / "gpu" / name / "sub"
        d.mkdir(parents=True)
        (d / "f").write_bytes(b"x" * size)
    return repo


def test_a_calls_size_is_the_checkout_plus_what_it_carries(tmp_path):
    repo = _repo(tmp_path)
    tree = 1000 + 300 + len("/gpu/\n")
    rows = call_sizes(str(repo), [Call("one", ("gpu/a",), "true", 600), Call("two", ("gpu/a", "gpu/b"), "true", 600)])
    assert [r["tree"] for r in rows] == [tree, tree]
    assert [r["total"] for r in rows] == [tree + 4000, tree + 6000]
    assert rows[1]["carried"] == {"gpu/a": 4000, "gpu/b": 2000} and all(r["fits"] for r in rows)


def test_a_call_over_the_limit_or_missing_a_folder_is_named_and_fails(tmp_path, monkeypatch, capsys):
    repo = _repo(tmp_path)
    calls = [Call("fine", ("gpu/a",), "true", 600), Call("gone", ("gpu/a", "gpu/nowhere"), "true", 600)]
    assert main([], repo=str(repo), calls=calls) == 1
    err = capsys.readouterr().err
    assert "call 'gone' cannot be made: missing gpu/nowhere" in err and "'fine'" not in err
    tree = 1000 + 300 + len("/gpu/\n")
    monkeypatch.setattr(gpu_calls, "LIMIT_BYTES", tree + 4000)  # exactly the first call's size: it still fits
    calls = [Call("edge", ("gpu/a",), "true", 600), Call("over", ("gpu/a", "gpu/b"), "true", 600)]
    assert main([], repo=str(repo), calls=calls) == 1
    out, err = capsys.readouterr()
    assert f"call 'over' cannot be made: {tree + 6000} bytes, over {tree + 4000} by 2000" in err
    lines = out.splitlines()  # three a call: its size, its arguments, its command
    assert "'edge'" not in err and "DOES NOT FIT" not in lines[0] and lines[3].endswith("DOES NOT FIT")
    assert main([], repo=str(repo), calls=calls[:1]) == 0


def test_the_json_gives_each_calls_device_arguments(tmp_path, capsys):
    import json

    repo = _repo(tmp_path)
    assert main(["--json"], repo=str(repo), calls=[Call("c", ("gpu/a",), "echo hi", 90)]) == 0
    assert json.loads(capsys.readouterr().out) == [dict(carry=["gpu/a"], command="echo hi", timeout_s=90)]


def test_the_limit_is_the_device_tools():
    assert LIMIT_BYTES == 64 * 1024 * 1024
