"""The next GPU session's device calls (docs/gpu.md, "The next GPU session, call by call"), each with what it carries,
checked against the device tool's limits here, before any device time is spent.

Every call sends the checkout (tracked files and untracked ones git does not ignore) plus the folders it carries, at
most 64 MiB in all; at most 8 carried paths, a command of at most 2000 characters, a limit of 1-600 s. The stack
(``gpu/s1``, ``gpu/s2``: the test bed's ``build_carry.sh``) and FlashInfer (``gpu/fi1``, ``gpu/fi2``:
``bash bench/gpu_flashinfer.sh pack``) are too large for one call beside the checkout, so their pieces ride in
different calls; each piece is staged in the call that carries it and installed once all are there.

    python bench/gpu_calls.py           # each call's size against 64 MiB, then its carry, limit and command
    python bench/gpu_calls.py --json    # the calls as the device tool's arguments (carry, command, timeout_s)

Exits 1, naming the call, when one is over the size limit, a folder it carries is missing (build it first), or
the steps it names (bench/gpu_session.sh) could outlast its timeout at their limits (the last one killed with the
call, its results lost).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

LIMIT_BYTES = 64 * 2 ** 20  # what one call may send: the checkout and its carried paths together
MAX_CARRY = 8
MAX_COMMAND = 2000
MAX_TIMEOUT_S = 600
SESSION_S = 900  # a session's device time, starts and idle waits included
SESSION_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_session.sh")


@dataclass(frozen=True)
class Call:
    """One device call: ``carry`` the git-ignored folders it takes beside the checkout, ``command`` run from the
    repository's root there, ``timeout_s`` its limit."""

    name: str
    carry: Tuple[str, ...]
    command: str
    timeout_s: int

    def __post_init__(self):
        if not 1 <= len(self.carry) <= MAX_CARRY:
            raise ValueError(f"Call {self.name!r}: carry names 1 to {MAX_CARRY} paths, got {len(self.carry)}")
        if not 0 < len(self.command) <= MAX_COMMAND:
            raise ValueError(f"Call {self.name!r}: command must be 1 to {MAX_COMMAND} characters, "
                             f"got {len(self.command)}")
        if not 1 <= self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"Call {self.name!r}: timeout_s must be in [1, {MAX_TIMEOUT_S}], got {self.timeout_s}")


# In order of need, back to back (the machine is handed back after ~30 s idle, losing what was staged). The stack's
# halves install once both are staged (setup.sh returns 2 until then; call.sh's stage exits 0 on it); FlashInfer's
# install exits 2 while a piece is missing, so no call's later commands wait on it.
CALLS = (
    Call("stage", ("gpu/tools", "gpu/s1"), "bash gpu/tools/call.sh stage 60", 120),
    # gpu/jit (SGLang's JIT kernels, compiled ahead) rides where the stack installs: setup.sh restores it only then
    Call("tests", ("gpu/tools", "gpu/jit", "gpu/s2", "gpu/fi1"),
         "source gpu/tools/setup.sh && { bash bench/gpu_flashinfer.sh install; "
         "STEPS=tests,host bash bench/gpu_session.sh; }", 520),
    Call("paired", ("gpu/tools", "gpu/fi2"),
         "source gpu/tools/setup.sh && { bash bench/gpu_flashinfer.sh install; "
         "STEPS=paired bash bench/gpu_session.sh; }", 500),
    Call("firandom", ("gpu/tools",), "source gpu/tools/setup.sh && STEPS=fi,firandom bash bench/gpu_session.sh", 600),
)
STEP_GRACE_S = 20  # gpu_session.sh's step(): timeout -k 20, a step that ignores the TERM is killed 20 s after it
SETUP_S = 60  # a call's own work besides its steps: setup.sh (the stack's install: 12-35 s), FlashInfer's unpacking


def step_limits(script: str) -> Dict[str, int]:
    """``{step: its time limit in seconds}`` as ``bench/gpu_session.sh`` (``script``) defines them."""
    with open(script) as f:
        return {m.group(1): int(m.group(2)) for m in re.finditer(r"^step (\w+) (\d+) ", f.read(), flags=re.M)}


def worst_case_s(call: Call, limits: Dict[str, int]) -> int:
    """The longest ``call`` can run: each gpu_session.sh step it names at its limit and its kill grace, plus the
    call's own work (:data:`SETUP_S`). A step a call names that the script does not define raises KeyError."""
    steps = [s for m in re.findall(r"STEPS=([\w,]+)", call.command) for s in m.split(",")]
    return SETUP_S + sum(limits[s] + STEP_GRACE_S for s in steps)


def _git_files(repo: str, *args: str) -> List[str]:
    out = subprocess.run(["git", "-C", repo, "ls-files", "-z", *args], check=True, capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f]


def _bytes(paths: Iterable[str]) -> int:
    """The summed sizes of ``paths`` (files, or folders walked; a link counts as itself)."""
    total = 0
    for p in paths:
        if os.path.isdir(p) and not os.path.islink(p):
            for root, _, files in os.walk(p):
                total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
        elif os.path.lexists(p):
            total += os.lstat(p).st_size
    return total


def tree_bytes(repo: str) -> int:
    """What every call sends of the checkout: its tracked files and the untracked ones git does not ignore."""
    files = _git_files(repo) + _git_files(repo, "--others", "--exclude-standard")
    return _bytes(os.path.join(repo, f) for f in files)


def call_sizes(repo: str, calls: Sequence[Call]) -> List[dict]:
    """Per call: its name, the checkout's bytes, each carried path's bytes (None: missing), the total, and whether
    it fits (every path there and the total within :data:`LIMIT_BYTES`)."""
    tree = tree_bytes(repo)
    rows = []
    for call in calls:
        paths = {p: os.path.join(repo, p) for p in call.carry}
        carried = {p: _bytes([path]) if os.path.exists(path) else None for p, path in paths.items()}
        total = tree + sum(b for b in carried.values() if b is not None)
        fits = None not in carried.values() and total <= LIMIT_BYTES
        rows.append(dict(name=call.name, tree=tree, carried=carried, total=total, fits=fits))
    return rows


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def main(argv=None, repo: str = None, calls: Sequence[Call] = CALLS) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="the calls as the device tool's arguments")
    a = ap.parse_args(argv)
    repo = repo or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = call_sizes(repo, calls)
    limits = step_limits(SESSION_SCRIPT)
    worst = {c.name: worst_case_s(c, limits) for c in calls}
    late = [c for c in calls if worst[c.name] > c.timeout_s]  # its last step would be killed with the call
    if a.json:
        print(json.dumps([dict(carry=list(c.carry), command=c.command, timeout_s=c.timeout_s) for c in calls],
                         indent=1))
    else:
        for call, row in zip(calls, rows):
            parts = " + ".join(f"{p} {'MISSING' if b is None else _mb(b)}" for p, b in row["carried"].items())
            flag = ("" if row["fits"] else "  <- DOES NOT FIT") \
                + ("  <- ITS STEPS OUTLAST IT" if call in late else "")
            print(f"{call.name}: {row['total'] / 2 ** 20:.1f} MiB of {LIMIT_BYTES // 2 ** 20} "
                  f"(checkout {_mb(row['tree'])} + {parts}){flag}")
            print(f"    carry {json.dumps(list(call.carry))}  timeout_s {call.timeout_s} (its steps at their "
                  f"limits: {worst[call.name]} s)\n    {call.command}")
        print(f"all calls at their limits: {sum(c.timeout_s for c in calls)} s of device time, machine start not "
              f"included; a session has {SESSION_S} s: the calls are in order of need, and the last gets what is left")
    bad = [r for r in rows if not r["fits"]]
    for r in bad:
        missing = [p for p, b in r["carried"].items() if b is None]
        why = f"missing {', '.join(missing)}" if missing else \
            f"{r['total']} bytes, over {LIMIT_BYTES} by {r['total'] - LIMIT_BYTES}"
        print(f"gpu_calls: call {r['name']!r} cannot be made: {why}", file=sys.stderr)
    for c in late:
        print(f"gpu_calls: call {c.name!r}: its steps at their limits take {worst[c.name]} s, over its timeout_s "
              f"{c.timeout_s}", file=sys.stderr)
    return 1 if bad or late else 0


if __name__ == "__main__":
    sys.exit(main())
