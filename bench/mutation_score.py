"""Mutation score of the pure core against its fast unit tests (mutmut; not part of CI).

For each module group below, a copy of the repository gets a ``[tool.mutmut]`` section naming the
group's files and its tests, and ``mutmut run`` mutates every function there (operators, constants,
comparisons, arguments...) and runs the tests that cover it. A mutant the tests still pass on
*survived*: either the tests miss a behaviour, or the mutant is equivalent (it cannot change any
output); each survivor is listed with ``mutmut show``-style diffs for review.

    pip install mutmut==3.8.1
    python bench/mutation_score.py                      # every group (hours on 2 cores)
    python bench/mutation_score.py --groups pool --max-children 2

Equivalent mutants (they cannot change any output) are recorded in ``bench/mutation_equivalent.json``:
per mutant its name, the mutated line (the ``+`` line of its diff) and why it is equivalent. A survivor is
counted as equivalent only while its current diff still holds that line (mutmut numbers mutants per
function, so an edited function renumbers them: a stale entry no longer matches and the survivor counts
again); equivalents are excluded from the score and printed separately, stale entries too.

Prints killed / survived / equivalent / other per group and the score killed / (killed + survived), where
survived includes the mutants no test covers ("no tests"), and
writes ``--out`` (JSON: counts, surviving and equivalent mutant names per group, and each survivor's diff).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the CPU name comes from the package's own helper
EQUIVALENT = os.path.join(ROOT, "bench", "mutation_equivalent.json")

GROUPS = {  # name -> (files to mutate, tests that guard them)
    "tree": (["treespec_sglang/tree/"], ["tests/tree", "tests/policies"]),  # the policies build every tree
    "verify": (["treespec_sglang/verify/"], ["tests/verify", "tests/test_lossless_loop.py"]),
    "policies": (["treespec_sglang/policies/"], ["tests/policies"]),
    "pool": (["treespec_sglang/plugin/pool.py", "treespec_sglang/plugin/pool_rules.py"],
             ["tests/plugin/test_pool.py", "tests/plugin/test_pool_edges.py", "tests/plugin/test_draft_select.py",
              "tests/plugin/test_pool_rules.py", "tests/plugin/test_rows.py", "tests/policies/test_none.py",
              # keeps_native_tree against the selection, registered pool rules, the kernels' host tables, the hand-off
              # to SGLang's tree builder (the kernels' interpreted oracle runs are the kernels group's)
              "tests/plugin/test_columns.py", "tests/plugin/test_custom_policy.py",
              "tests/plugin/test_pool_kernels_host.py", "tests/plugin/test_handoff.py",
              "tests/plugin/test_draft_select_edges.py"]),
    "ragged": (["treespec_sglang/plugin/ragged.py", "treespec_sglang/plugin/ragged_support.py"],
               ["tests/plugin/test_ragged.py", "tests/plugin/test_ragged_support.py",
                "tests/plugin/test_ragged_tokens.py", "tests/plugin/test_ragged_hooks.py",
                "tests/plugin/test_ragged_flashinfer.py"]),
    # the multi-rank agreements (every per-round decision identical on every rank): gloo groups on the CPU
    "ranks": (["treespec_sglang/plugin/ranks.py"],
              ["tests/plugin/test_ranks.py", "tests/plugin/test_ranks_hot_head.py", "tests/plugin/test_draft_select.py",
               "tests/plugin/test_chain_graph.py", "tests/plugin/test_ragged_tuner.py",
               "tests/plugin/test_ragged_tuner_options.py"]),
    # a batch's columns, parameter rows and stats, carried over a changed batch (the host work of every round)
    "rounds": (["treespec_sglang/plugin/columns.py", "treespec_sglang/plugin/rows.py",
                "treespec_sglang/plugin/stats.py", "treespec_sglang/plugin/pending.py",
                "treespec_sglang/plugin/round.py", "treespec_sglang/plugin/batch_diff.py"],
               ["tests/plugin/test_columns.py", "tests/plugin/test_rows.py", "tests/plugin/test_round.py",
                "tests/plugin/test_batch_diff.py",
                "tests/plugin/test_stats.py", "tests/plugin/test_pending.py", "tests/plugin/test_request.py",
                "tests/plugin/test_sglang_rounds.py", "tests/plugin/test_handoff.py", "tests/plugin/test_metrics.py",
                "tests/plugin/test_draft_select.py", "tests/plugin/test_pool.py", "tests/plugin/test_custom_policy.py",
                "tests/plugin/test_profile.py", "tests/plugin/test_graph_log.py"]),
    # what comes in: a request's custom_params, the server's flags and environment, the classifier registry (bad
    # input refused naming the field and the allowed range; no path a client names is ever opened)
    "requests": (["treespec_sglang/plugin/request.py", "treespec_sglang/plugin/config.py",
                  "treespec_sglang/plugin/classifiers.py", "treespec_sglang/plugin/settings.py"],
                 ["tests/plugin/test_request.py", "tests/plugin/test_config.py", "tests/plugin/test_classifiers.py",
                  "tests/plugin/test_settings.py", "tests/plugin/test_custom_policy.py", "tests/plugin/test_info.py",
                  "tests/plugin/test_sglang_real.py", "tests/plugin/test_columns.py"]),
    # the selection's host side: the draft hooks' staging, chain mode's C2T stop, the CUDA-graph wrappers (their
    # capture=False path on the CPU)
    "selection": (["treespec_sglang/plugin/draft_select.py", "treespec_sglang/plugin/chain_stop.py",
                   "treespec_sglang/plugin/select_graph.py", "treespec_sglang/plugin/chain_graph.py"],
                  ["tests/plugin/test_draft_select.py", "tests/plugin/test_draft_select_edges.py",
                   "tests/plugin/test_chain_stop.py",
                   "tests/plugin/test_select_graph.py", "tests/plugin/test_chain_graph.py",
                   "tests/plugin/test_sglang_rounds.py", "tests/plugin/test_handoff.py", "tests/plugin/test_columns.py"]),
    # the ragged verify's tuner: its schedule, decisions, agreements and the turns it passes on
    "tuner": (["treespec_sglang/plugin/ragged_tuner.py"],
              ["tests/plugin/test_ragged_tuner.py", "tests/plugin/test_ragged_tuner_options.py",
               "tests/plugin/test_ragged.py", "tests/plugin/test_ragged_hooks.py"]),
    # what an operator reads off a server: Prometheus series, SGLang's CUDA-graph decisions, the round profile's
    # timers, the ``treespec`` section of /server_info
    "observability": (["treespec_sglang/plugin/metrics.py", "treespec_sglang/plugin/graph_log.py",
                       "treespec_sglang/plugin/profile.py", "treespec_sglang/plugin/info.py"],
                      ["tests/plugin/test_metrics.py", "tests/plugin/test_graph_log.py", "tests/plugin/test_profile.py",
                       "tests/plugin/test_info.py", "tests/plugin/test_sglang_real.py", "tests/plugin/test_stats.py",
                       "tests/bench/test_round_pairs.py"]),
    # the fused kernels' host side (the Triton source, pool_kernels_triton.py, is loaded by path and not mutated:
    # mutmut's trampolines would replace what @triton.jit parses); their tests run the kernels in Triton's interpreter
    "kernels": (["treespec_sglang/plugin/pool_kernels.py", "treespec_sglang/plugin/unlink_kernel.py"],
                ["tests/plugin/test_pool_kernels.py", "tests/plugin/test_pool_kernels_host.py",
                 "tests/plugin/test_unlink_kernel.py", "tests/plugin/test_kernel_compile.py",
                 "tests/plugin/test_select_graph.py"]),
    # where SGLang calls in: the hooks of a round, the server-side hooks (flags, requests, metrics, the draft
    # graph's vote) and the source patches where no hook reaches
    "serving": (["treespec_sglang/plugin/hooks.py", "treespec_sglang/plugin/server_hooks.py",
                 "treespec_sglang/plugin/patching.py"],
                ["tests/plugin/test_patching.py", "tests/plugin/test_config.py", "tests/plugin/test_sglang_real.py",
                 "tests/plugin/test_sglang_rounds.py", "tests/plugin/test_handoff.py", "tests/plugin/test_request.py",
                 "tests/plugin/test_settings.py", "tests/plugin/test_ragged_hooks.py", "tests/plugin/test_chain_stop.py",
                 "tests/plugin/test_ranks.py", "tests/plugin/test_draft_select.py",
                 "tests/plugin/test_draft_select_edges.py", "tests/plugin/test_metrics.py",
                 "tests/plugin/test_profile.py", "tests/plugin/test_columns.py", "tests/plugin/test_hooks.py",
                 "tests/plugin/test_server_hooks.py", "tests/plugin/test_register.py"]),
    # the reference engine: a round's stages (draft expansion, tree verify, KV commit), the batch's ragged tails, the
    # exactness checks, the token cap, requests, the engine's loop, and the dense attention oracle it verifies with
    "engine": (["treespec_sglang/engine/round.py", "treespec_sglang/engine/expander.py",
                "treespec_sglang/engine/kv_cache.py", "treespec_sglang/engine/batch_tail.py",
                "treespec_sglang/engine/exactness.py", "treespec_sglang/engine/token_cap.py",
                "treespec_sglang/engine/requests.py", "treespec_sglang/engine/engine.py",
                "treespec_sglang/engine/calls.py", "treespec_sglang/attention/reference.py"],
               ["tests/engine", "tests/attention", "tests/test_lossless_loop.py", "tests/cli/test_peers_exactness.py"]),
    # draft training: the objectives (KL, LK, TALF), TALF's target-built trees, the C2T classifier's data and
    # training, the truncated vocabulary's token map
    "training": (["treespec_sglang/training/losses.py", "treespec_sglang/training/talf.py",
                  "treespec_sglang/training/c2t.py", "treespec_sglang/training/vocab.py"],
                 ["tests/training"]),
    # the sgl_kernel stand-ins SGLang runs on in the CPU test bed: each computes what the kernel it replaces computes
    # and refuses what that kernel refuses (contiguity, dtype, shape, device)
    "standins": (["treespec_sglang/plugin/cpu/matcher.py", "treespec_sglang/plugin/cpu/kernels.py",
                  "treespec_sglang/plugin/cpu/sampling.py", "treespec_sglang/plugin/cpu/attention.py",
                  "treespec_sglang/plugin/cpu/overlap.py"],
                 ["tests/plugin/cpu/test_matcher.py", "tests/plugin/cpu/test_strict.py",
                  "tests/plugin/cpu/test_kernels.py", "tests/plugin/cpu/test_sampling.py",
                  "tests/plugin/cpu/test_attention.py", "tests/plugin/cpu/test_overlap.py"]),
}
# groups whose tests run the group's code in spawned processes (gloo ranks: ``tests.helpers.run_ranks``; a fresh
# interpreter). mutmut maps a test to the functions it calls in its own process only, so a function only such a
# process calls would be left with no test (or with only its single-process tests); after the first run (and after a
# retest's rerun) every function of the group is mapped to these tests too and the survivors run again
# (:func:`spawned_tests`; the child inherits the mutant's name from the environment).
SPAWNED = {"ranks": ["tests/plugin/test_ranks.py", "tests/plugin/test_ranks_hot_head.py"],
           "selection": ["tests/plugin/test_chain_stop.py"],
           # a process that imported triton interpreted (the loader's other branch, and a warm-up there)
           "kernels": ["tests/plugin/test_pool_kernels_host.py::test_a_process_that_imported_triton_interpreted"]}
# (``standins``' Triton-oracle test runs its code in a child too, but at ~1 min a mutant under mutmut: its survivors
# were run against the oracle in one process instead, see docs/testing.md)
# the tests' marker expression per group: SGLang's group helpers (``verify_group``) and a round's hooks on SGLang's
# own batch objects are unit-tested with sglang imported, which these groups need
WITH_SGLANG = "not gpu and not slow and not e2e"
MARKERS = {"ranks": WITH_SGLANG, "rounds": WITH_SGLANG, "requests": WITH_SGLANG, "selection": WITH_SGLANG,
           "standins": WITH_SGLANG, "observability": WITH_SGLANG, "serving": WITH_SGLANG}
DEFAULT_MARKERS = WITH_SGLANG + " and not sglang"
# tests that cannot pass under mutmut at all: its trampolines read os.environ (MUTANT_UNDER_TEST) on every call;
# and tests that write to the installed SGLang: a mutant of the patch tool's apply or revert would leave the real
# site-packages patched for every later test (the same code is tested on a synthetic site)
DESELECT = ["tests/plugin/test_settings.py::test_a_round_reads_no_environment_once_frozen",
            "tests/plugin/test_patching.py::test_patches_apply_and_revert_on_the_installed_sglang"]


def _toml_list(xs):
    return "[" + ", ".join(json.dumps(x) for x in xs) + "]"


def prepare(group: str, work: str, only=None) -> str:
    """A copy of the tracked tree in ``work`` whose pyproject.toml names the group for mutmut (``only``: a
    subset of the group's files to mutate, e.g. one file of a large group)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        # bench/*.py: a test may import a bench helper (the FlashInfer verify layouts)
        bench_py = f.startswith("bench/") and f.endswith(".py")
        # docs/: a test may check the code against what the docs say (the metrics table)
        if f.startswith(("treespec_sglang/", "tests/", "docs/", "pyproject.toml")) or bench_py:
            dst = os.path.join(work, f)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), dst)
    paths, tests = GROUPS[group]
    if only:
        outside = [f for f in only if not any(f.startswith(p) for p in paths)]
        if outside:
            raise SystemExit(f"--only {outside}: not in group {group!r} ({paths})")
        paths = only
    args = ["-x", "-q", "-p", "no:cacheprovider", "-m", MARKERS.get(group, DEFAULT_MARKERS)]
    args += [a for t in DESELECT for a in ("--deselect", t)]
    if "not sglang" not in args[args.index("-m") + 1]:  # SGLang imported once, in mutmut's fork server
        args += ["-p", "bench.mutmut_preload"]
    with open(os.path.join(work, "pyproject.toml"), "a") as fh:
        only = [x + "*" if x.endswith("/") else x for x in paths]  # glob patterns
        fh.write(f"\n[tool.mutmut]\nsource_paths = [\"treespec_sglang\"]\nonly_mutate = {_toml_list(only)}\n"
                 f"pytest_add_cli_args_test_selection = {_toml_list(tests)}\n"
                 f"pytest_add_cli_args = {_toml_list(args)}\nalso_copy = [\"tests\", \"bench\", \"docs\"]\n"
                 # each mutant in a fresh child of a server that only collected the tests: the per-process
                 # caches (parameter rows, index tables) start empty, so a mutated builder is exercised
                 f"process_isolation = \"forkserver\"\nforkserver_warmup = \"collect\"\n")
    return work


# run inside a group's work dir: the unified diff of each named mutant (JSON on stdout)
_DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = get_diff_for_mutant(name)
    except Exception as e:  # noqa: BLE001 (a mutant mutmut can no longer locate)
        out[name] = f"<no diff: {e!r}>"
print(json.dumps(out))
"""


def load_equivalent(path: str = EQUIVALENT) -> dict:
    """``{mutant name: (mutated line, reason)}`` from the recorded equivalent mutants (all groups)."""
    if not os.path.exists(path):
        return {}
    return {e["mutant"]: (e["line"], e["reason"]) for e in json.load(open(path))["equivalent"]}


def mutated_lines(diff: str) -> list:
    """The ``+`` lines of a unified diff (stripped), headers excluded."""
    return [x[1:].strip() for x in diff.splitlines() if x.startswith("+") and not x.startswith("+++")]


def classify(survivors: list, diffs: dict, equivalent: dict):
    """Split survivors into (real, equivalent, stale): a listed survivor is equivalent while its diff still
    holds the recorded line; a listed one whose line no longer matches is stale (and counts as real)."""
    real, equiv, stale = [], [], []
    for name in survivors:
        if name in equivalent:
            if equivalent[name][0].strip() in mutated_lines(diffs.get(name, "")):
                equiv.append(name)
                continue
            stale.append(name)
        real.append(name)
    return real, equiv, stale


def statuses(work: str, env: dict) -> dict:
    """``{mutant name: status}`` of every mutant of a work dir (``mutmut results --all true``: killed,
    survived, no tests, timeout, not checked, ...)."""
    res = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=work, env=env,
                         capture_output=True, text=True).stdout
    return {m.strip(): st.strip() for m, _, st in (x.partition(":") for x in res.splitlines() if ":" in x)}


KEPT = "treespec-statuses.json"  # in a work dir: every mutant's status as this script last reported it


def kept_statuses(work: str, env: dict) -> dict:
    """:func:`statuses`, where a "not checked" mutant (a retest's new tests made mutmut collect stats again and
    forget what it did not rerun) takes the status this script last reported for it in ``work``."""
    path = os.path.join(work, KEPT)
    saved = json.load(open(path)) if os.path.exists(path) else {}
    return {m: saved.get(m, st) if st == "not checked" else st for m, st in statuses(work, env).items()}


def changed_sources(work: str) -> list:
    """The package's files (``treespec_sglang/``) that differ between this checkout and a kept work dir's
    unmutated copy, or exist in only one of them: a retest there would run today's tests on its old code."""
    tracked = subprocess.run(["git", "ls-files", "treespec_sglang"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    here = {f for f in tracked if os.path.exists(os.path.join(ROOT, f))}
    kept = {os.path.relpath(os.path.join(d, f), work) for d, _, fs in os.walk(os.path.join(work, "treespec_sglang"))
            for f in fs if "__pycache__" not in d}

    def same(f):
        with open(os.path.join(ROOT, f), "rb") as a, open(os.path.join(work, f), "rb") as b:
            return a.read() == b.read()
    return sorted((here ^ kept) | {f for f in here & kept if not same(f)})


def mutmut_run(work: str, env: dict, max_children: int, names=()) -> None:
    """``mutmut run`` in ``work`` (every mutant, or ``names``); a run that stops early (its stats collection or
    clean test run failed: it says which above) is refused, so no earlier result is reported as this run's."""
    rc = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children), *names],
                        cwd=work, env=env).returncode
    if rc != 0:
        raise SystemExit(f"mutmut run in {work} exited {rc} before its mutants ran (its output above says why); "
                         f"its results are not this run's")


def spawned_tests(work: str, prefixes: list, env: dict) -> list:
    """Map every mutated function of a work dir to the collected tests under ``prefixes`` as well (in mutmut's
    stats file: its own tracing sees no call a spawned rank makes) and return the mutants to run again: those
    that survived or had no test (read with the run's ``env``)."""
    path = os.path.join(work, "mutants", "mutmut-stats.json")
    st = json.load(open(path))
    extra = {t for t in st["duration_by_test"] if t.startswith(tuple(prefixes))}
    mapped = st["tests_by_mangled_function_name"]
    for fn in st["function_hashes"]:  # the functions of the mutated files
        mapped[fn] = sorted(set(mapped.get(fn, ())) | extra)
    with open(path, "w") as fh:
        json.dump(st, fh)
    return [m for m, status in statuses(work, env).items() if status in ("survived", "no tests")]


def run_group(group: str, max_children: int, keep: bool, only=None, reuse=None, retest=False) -> dict:
    """Mutate and test one group in a fresh copy. With ``reuse`` (a kept work dir): only re-read its results,
    e.g. after recording equivalent mutants; with ``retest`` too, first copy the current tests in and run
    the mutants that survived there again (tests only added since: a killed mutant stays killed).
    Returns the group's row of the report."""
    work = reuse or tempfile.mkdtemp(prefix=f"mutmut-{group}-")
    if not reuse:
        prepare(group, work, only)
    # one OpenMP thread: mutmut forks its test runs from a process that already ran torch ops, and a forked
    # child of a multi-threaded OpenMP runtime can hang (mutants then end as timeouts)
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t0 = time.time()
    if not reuse:
        mutmut_run(work, env, max_children)
    elif retest:
        changed = changed_sources(work)
        if changed:
            raise SystemExit(f"--retest: {work}'s mutants are of older code ({', '.join(changed)} changed since): "
                             f"run the group afresh")
        for d in ("tests", "bench", "docs"):  # the current tests (and the docs they check), in the work dir and
            # in mutmut's copy of it
            for dst in (os.path.join(work, d), os.path.join(work, "mutants", d)):
                shutil.copytree(os.path.join(ROOT, d), dst, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__", "measured", "data"))
        before = kept_statuses(work, env)
        again = [m for m, st in before.items() if st in ("survived", "no tests")]
        if again:
            mutmut_run(work, env, max_children, again)
    if (not reuse or retest) and group in SPAWNED:  # (a retest's new tests were mapped afresh: map these again)
        again = spawned_tests(work, SPAWNED[group], env)
        if again:
            mutmut_run(work, env, max_children, again)
    wall = time.time() - t0
    subprocess.run([sys.executable, "-m", "mutmut", "export-cicd-stats"], cwd=work, env=env, capture_output=True)
    stats_file = os.path.join(work, "mutants", "mutmut-cicd-stats.json")
    stats = json.load(open(stats_file)) if os.path.exists(stats_file) else {}
    now = kept_statuses(work, env)
    if reuse and retest:
        # new tests make mutmut collect stats again and forget every result it did not rerun ("not checked"):
        # those keep the status they had before the rerun
        now = {m: before.get(m, st) if st == "not checked" else st for m, st in now.items()}
    if reuse:
        stats = {"total": len(now), **collections.Counter(st.replace(" ", "_") for st in now.values())}
    with open(os.path.join(work, KEPT), "w") as fh:  # what a later retest or re-read there starts from
        json.dump(now, fh)
    survivors = [m for m, st in now.items() if st == "survived"]
    no_tests = [m for m, st in now.items() if st == "no tests"]
    diffs = json.loads(subprocess.run([sys.executable, "-c", _DIFFS, *survivors, *no_tests], cwd=work, env=env,
                                      capture_output=True, text=True).stdout or "{}")
    real, equiv, stale = classify(survivors + no_tests, diffs, load_equivalent())
    no_tests = [m for m in no_tests if m in real]  # a mutant no test runs counts as survived
    killed = stats.get("killed", 0)
    out = dict(group=group, files=only or GROUPS[group][0], wall_s=None if reuse and not retest else round(wall),
               total=stats.get("total"), killed=killed, survived=len(real), equivalent=len(equiv),
               other={k: v for k, v in stats.items() if k not in ("killed", "survived", "no_tests", "total") and v},
               score=round(killed / max(killed + len(real), 1), 3), survivors=real, equivalent_mutants=equiv,
               stale_equivalent=stale, no_tests=no_tests, diffs=diffs, workdir=work)
    if reuse and not retest:  # a re-read: of the kept run's code, which may not be this checkout's any more
        out["changed_since"] = changed_sources(work)
    if not keep and not reuse:
        shutil.rmtree(work, ignore_errors=True)
        out.pop("workdir")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", default=",".join(GROUPS))
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep each group's work dir (to run `mutmut show NAME`)")
    ap.add_argument("--out", default="bench/results/mutation_score.json")
    ap.add_argument("--only", default="", help="comma-separated files of ONE group to mutate instead of all of "
                    "its files (a large group one file at a time)")
    ap.add_argument("--reuse", default="", help="a kept work dir of ONE group: re-read its results (no new run; "
                    "the package files changed since are named)")
    ap.add_argument("--retest", action="store_true", help="with --reuse: copy the current tests in and run the "
                    "surviving mutants again (refused when the package changed since the kept run)")
    a = ap.parse_args(argv)
    rows = []
    for g in a.groups.split(","):
        r = run_group(g, a.max_children, a.keep, [f for f in a.only.split(",") if f] or None, a.reuse or None,
                      a.retest)
        rows.append(r)
        print(f"{g}: killed {r['killed']}, survived {r['survived']}, equivalent {r['equivalent']} (excluded), "
              f"other {r['other']}, score {r['score']}", flush=True)
        for s in r["survivors"]:
            print("  survived:", s)
        for s in r["no_tests"]:
            print("  no tests:", s)
        for s in r["equivalent_mutants"]:
            print("  equivalent:", s)
        for s in r["stale_equivalent"]:
            print("  stale equivalent entry (diff changed, counted as survived):", s)
        if r.get("changed_since"):
            print("  these are results of older code: changed since the kept run:", ", ".join(r["changed_since"]))
    write_report(a.out, rows)
    return rows


def write_report(path: str, rows: list) -> None:
    """Merge ``rows`` into the JSON report at ``path`` (one entry per group; a group run one file at a time
    keeps one entry per file set), so groups scored in separate runs share one file."""
    from treespec_sglang.engine.cost import _cpu_name

    report = json.load(open(path)) if os.path.exists(path) else {}
    if not isinstance(report, dict):  # an older list-shaped report
        report = {}
    runs = report.get("runs", {})
    for r in rows:
        key = r["group"] if r["files"] == GROUPS[r["group"]][0] else f"{r['group']}:{','.join(r['files'])}"
        runs[key] = {k: v for k, v in r.items() if k != "workdir"}
    report.update(cpu=f"{_cpu_name()}, {os.cpu_count()} cores", mutmut="3.8.1", runs=runs)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
