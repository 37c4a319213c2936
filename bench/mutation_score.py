"""Mutation score of the pure core against its fast unit tests (mutmut; not part of CI).

For each module group below, a copy of the repository gets a ``[tool.mutmut]`` section naming the
group's files and its tests, and ``mutmut run`` mutates every function there (operators, constants,
comparisons, arguments...) and runs the tests that cover it. A mutant the tests still pass on
*survived*: either the tests miss a behaviour, or the mutant is equivalent (it cannot change any
output); each survivor is listed with ``mutmut show``-style diffs for review.

    pip install mutmut==3.8.1
    python bench/mutation_score.py                      # every group (hours on 2 cores)
    python bench/mutation_score.py --groups pool --max-children 2

Prints killed / survived / other per group and the score killed / (killed + survived), and writes
``--out`` (JSON: counts and surviving mutant names per group).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GROUPS = {  # name -> (files to mutate, tests that guard them)
    "tree": (["treespec_sglang/tree/"], ["tests/tree", "tests/policies"]),  # the policies build every tree
    "verify": (["treespec_sglang/verify/"], ["tests/verify", "tests/test_lossless_loop.py"]),
    "policies": (["treespec_sglang/policies/"], ["tests/policies"]),
    "pool": (["treespec_sglang/plugin/pool.py", "treespec_sglang/plugin/pool_rules.py"],
             ["tests/plugin/test_pool.py", "tests/plugin/test_draft_select.py", "tests/policies/test_none.py"]),
    "ragged": (["treespec_sglang/plugin/ragged.py"], ["tests/plugin/test_ragged.py"]),
}


def _toml_list(xs):
    return "[" + ", ".join(json.dumps(x) for x in xs) + "]"


def prepare(group: str, work: str) -> str:
    """A copy of the tracked tree in ``work`` whose pyproject.toml names the group for mutmut."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if f.startswith(("treespec_sglang/", "tests/", "pyproject.toml")):
            dst = os.path.join(work, f)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), dst)
    paths, tests = GROUPS[group]
    with open(os.path.join(work, "pyproject.toml"), "a") as fh:
        only = [x + "*" if x.endswith("/") else x for x in paths]  # glob patterns
        fh.write(f"\n[tool.mutmut]\nsource_paths = [\"treespec_sglang\"]\nonly_mutate = {_toml_list(only)}\n"
                 f"pytest_add_cli_args_test_selection = {_toml_list(tests)}\n"
                 f"pytest_add_cli_args = [\"-x\", \"-q\", \"-p\", \"no:cacheprovider\", \"-m\", \"not gpu and not slow "
                 f"and not e2e and not sglang\"]\nalso_copy = [\"tests\"]\n"
                 # each mutant in a fresh child of a server that only collected the tests: the per-process
                 # caches (parameter rows, index tables) start empty, so a mutated builder is exercised
                 f"process_isolation = \"forkserver\"\nforkserver_warmup = \"collect\"\n")
    return work


def run_group(group: str, max_children: int, keep: bool) -> dict:
    work = tempfile.mkdtemp(prefix=f"mutmut-{group}-")
    prepare(group, work)
    # one OpenMP thread: mutmut forks its test runs from a process that already ran torch ops, and a forked
    # child of a multi-threaded OpenMP runtime can hang (mutants then end as timeouts)
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children)], cwd=work, env=env)
    subprocess.run([sys.executable, "-m", "mutmut", "export-cicd-stats"], cwd=work, env=env, capture_output=True)
    stats_file = os.path.join(work, "mutants", "mutmut-cicd-stats.json")
    stats = json.load(open(stats_file)) if os.path.exists(stats_file) else {}
    res = subprocess.run([sys.executable, "-m", "mutmut", "results"], cwd=work, env=env, capture_output=True,
                         text=True).stdout
    survivors = [line.split(":")[0].strip() for line in res.splitlines() if "survived" in line]
    killed, survived = stats.get("killed", 0), stats.get("survived", len(survivors))
    out = dict(group=group, killed=killed, survived=survived,
               other={k: v for k, v in stats.items() if k not in ("killed", "survived")},
               score=round(killed / max(killed + survived, 1), 3), survivors=survivors, workdir=work)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
        out.pop("workdir")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", default=",".join(GROUPS))
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep each group's work dir (to run `mutmut show NAME`)")
    ap.add_argument("--out", default="bench/results/mutation_score.json")
    a = ap.parse_args(argv)
    rows = []
    for g in a.groups.split(","):
        r = run_group(g, a.max_children, a.keep)
        rows.append(r)
        print(f"{g}: killed {r['killed']}, survived {r['survived']}, other {r['other']}, score {r['score']}",
              flush=True)
        for s in r["survivors"]:
            print("  survived:", s)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
