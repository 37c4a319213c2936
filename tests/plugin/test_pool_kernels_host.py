"""The fused selection's host side (:mod:`treespec_sglang.plugin.pool_kernels`, without running the kernel where
the test is about what the host hands it): the source loaded per mode on any triton, the mode a device runs in,
the kind -> stage and classifier tables, every launch's arguments against the kernel's signature, the warm-up's
variants against a round's, and ``select_on_pool_fused``'s input checks. ``test_pool_kernels.py`` runs the kernel
against the torch selection."""

import itertools
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, checkout_env
from tests.plugin.kernel_cases import (KERNEL_INTS, KERNEL_POINTERS, STAGES, compiled_triton, make_pool, native_of,
                                       random_spec)
from treespec_sglang.plugin import pool_kernels
from treespec_sglang.plugin.pool import COLUMNS, PoolView, first_child_parents, kind_id, policy_rows, select_on_pool
from treespec_sglang.policies import parse_spec
from treespec_sglang.policies.classifier import C2TClassifier
from treespec_sglang.policies.registry import REGISTRY

triton = pytest.importorskip("triton")
from treespec_sglang.plugin.pool_kernels import kernels, select_on_pool_fused  # noqa: E402


def pow2_at_least(n):
    return next(1 << i for i in itertools.count() if 1 << i >= n)


class RecordingKernels:
    """:func:`kernels`' module with the selection kernel recording each launch (its arguments) instead of running.
    ``variant(call)``: what picks a compiled variant, each argument's dtype (or type), the constexprs and the warps
    (the runtime ints are ``do_not_specialize``); ``check(call, k, S, N)``: the launch against the kernel's
    signature."""

    def __init__(self, real):
        self.N_WORK, self.N_WORKF, self.calls = real.N_WORK, real.N_WORKF, []
        calls = self.calls

        class Kernel:
            def __getitem__(self, grid):
                return lambda *args, **kw: calls.append((grid, args, kw))
        self.pool_select_kernel = Kernel()

    @staticmethod
    def variant(call):
        _, args, kw = call
        return (tuple(str(a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args),
                tuple(sorted(kw.items())))

    def check(self, call, k, S, N):
        """Each pointer argument a contiguous tensor of the dtype and shape the kernel indexes (an absent input a
        one-element stand-in of that dtype, never None), the runtime ints Python ints, each block the smallest
        power of two that holds its extent, the scratch as wide as the kernel indexes it, :func:`warps`' warps."""
        (bs,), args, kw = call
        P, F = k + (S - 1) * k * k, len(COLUMNS)
        t = dict(zip([name for name, _ in KERNEL_POINTERS], args))
        ints = args[len(KERNEL_POINTERS):]
        assert [a.dtype if isinstance(a, torch.Tensor) else None for a in args[:len(KERNEL_POINTERS)]] == [
            dtype for _, dtype in KERNEL_POINTERS]
        assert all(a.is_contiguous() for a in t.values()) and len(ints) == len(KERNEL_INTS)
        assert all(type(i) is int for i in ints), ints
        assert (kw["F"], kw["K"], kw["S"], kw["P"], kw["N"]) == (F, k, S, P, N)
        blocks = dict(BLOCK_P=pow2_at_least(P), BLOCK_W=pow2_at_least(k * k), BLOCK_K=pow2_at_least(k),
                      BLOCK_N=pow2_at_least(N))
        assert {b: kw[b] for b in blocks} == blocks
        assert kw["CHUNK"] == min(blocks["BLOCK_P"], 32) and type(kw["num_warps"]) is int
        assert kw["num_warps"] == min(8, max(1, blocks["BLOCK_P"] // 32))
        shapes = {"scores_ptr": (bs, P), "val_ptr": (bs, P), "parent_ptr": (bs, P), "tokens_ptr": (bs, P),
                  "rows_ptr": (bs, F), "stage_ptr": (1 + len(REGISTRY),), "top_ptr": (bs, N - 1),
                  "tok_ptr": (bs, N - 1), "keep_ptr": (bs, N), "work_ptr": (bs, self.N_WORK * blocks["BLOCK_P"]),
                  "workf_ptr": (bs, self.N_WORKF * blocks["BLOCK_P"])}
        assert {name: tuple(t[name].shape) for name in shapes} == shapes
        assert tuple(t["native_ptr"].shape) in ((bs, N - 1), (1,)) and tuple(t["extra_ptr"].shape) in ((bs, P), (1,))
        assert tuple(t["conf_ptr"].shape) == (bs, P) if kw["WRITE_CONF"] else t["conf_ptr"] is t["workf_ptr"]
        n_clf = t["clf_ids_ptr"].numel()
        assert tuple(t["clf_w_ptr"].shape) == (n_clf, 6, kw["HB"]) or t["clf_w_ptr"].numel() == n_clf == 1


@pytest.fixture
def recording(monkeypatch):
    rec = RecordingKernels(kernels(True))
    monkeypatch.setattr(pool_kernels, "kernels", lambda interpret: rec)
    return rec


# ------------------------------------------------------------------------------------------ loading, mode
@pytest.mark.parametrize("device,env,expected", [
    ("cpu", None, True), ("cuda", None, False), ("cuda", "0", False), ("cuda", "", False), ("cuda", "1", True),
    ("cuda", "true", True), ("cuda", "ON", True), ("cuda:1", "True", True)])
def test_a_device_runs_the_interpreter_off_cuda_or_when_triton_interpret_is_set(device, env, expected, monkeypatch):
    if env is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", env)
    assert pool_kernels.interpreted(device) is expected


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_on_a_triton_without_knobs_the_source_loads_per_mode_through_the_environment(before, monkeypatch):
    """An older triton (no ``triton.knobs``) reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates: the loader
    sets it for the load only and puts back what was there (unset, or its value)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    monkeypatch.delattr(triton, "knobs")
    monkeypatch.setattr(pool_kernels, "_KERNELS", {})
    if before is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", before)
    mod = kernels(True)
    assert isinstance(mod.pool_select_kernel, InterpretedFunction)
    assert mod.__name__ == "treespec_sglang.plugin.pool_kernels_triton_interpret"
    assert os.environ.get("TRITON_INTERPRET") == before
    if compiled_triton():
        jit = kernels(False)
        assert type(jit.pool_select_kernel) is JITFunction  # InterpretedFunction is no JITFunction subclass
        assert jit.__name__ == "treespec_sglang.plugin.pool_kernels_triton_jit"
        assert os.environ.get("TRITON_INTERPRET") == before
    assert kernels(True) is mod


def test_on_a_triton_with_knobs_the_load_overrides_a_mode_other_code_set_there(monkeypatch):
    """A mode set in triton's knobs from Python (no longer read from the environment) decides nothing: each mode
    loads its own source, and the knob is put back."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(pool_kernels, "_KERNELS", {})
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        assert isinstance(kernels(True).pool_select_kernel, InterpretedFunction)
        assert triton.knobs.runtime.interpret is False
        if compiled_triton():
            triton.knobs.runtime.interpret = True
            assert type(kernels(False).pool_select_kernel) is JITFunction
            assert triton.knobs.runtime.interpret is True


def test_a_triton_lacking_what_the_kernels_use_is_named(monkeypatch):
    import triton.language.standard as standard

    monkeypatch.delattr(standard, "_elementwise_max")
    monkeypatch.setattr(pool_kernels, "_KERNELS", {})
    with pytest.raises(RuntimeError, match=r"this triton lacks what the kernels use \(ImportError: .*_elementwise_max"):
        kernels(True)


def test_a_process_that_imported_triton_interpreted_runs_the_interpreter_and_refuses_compiled_kernels():
    """``TRITON_INTERPRET=1`` when triton was imported interprets triton's own library: the interpreted source
    loads and a server's warm-up runs on it; compiled kernels are refused with the reason (in a fresh process)."""
    code = ("import os\nos.environ['TRITON_INTERPRET'] = '1'\nimport triton\n"
            "from triton.runtime.interpreter import InterpretedFunction\n"
            "from treespec_sglang.plugin import pool_kernels as pk\n"
            "assert isinstance(pk.kernels(True).pool_select_kernel, InterpretedFunction)\n"
            "pk.warm_up('cpu', 2, 3, 6)\n"
            "try:\n    pk.kernels(False)\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=checkout_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == (
        "refused: select_on_pool_fused: triton was imported with TRITON_INTERPRET=1, so this process cannot compile "
        "kernels (its own library is interpreted); run without it for the GPU")


# ------------------------------------------------------------------------------------------ tables
def test_the_stage_table_gives_every_registered_kind_its_stage(custom):
    """Native rows rank (0); each policy its pool rule's stage code; a policy without a pool rule -1 (the kernel
    leaves its rows to SGLang's ranking); int32, one table per device and registry."""
    expected = {"native": 0, "eagle2": 0, "none": 0, "talon": 1, "c2t": 2, "chain": 3, "salf": 4,
                "root-children": 5, "engine-only": -1}
    table = pool_kernels.stage_table("cpu")
    assert table.dtype == torch.int32 and table.device.type == "cpu"
    assert {name: int(table[kind_id(name)]) for name in expected} == expected
    assert table.numel() == 1 + len(REGISTRY)
    meta = pool_kernels.stage_table("meta")
    assert meta.device.type == "meta" and pool_kernels.stage_table("cpu") is table


def _bad(what):
    m = C2TClassifier(hidden=8)
    if what == "own-forward":
        m = type("Scaled", (C2TClassifier,), {"forward": lambda self, x: 2 * C2TClassifier.forward(self, x)})(hidden=8)
    elif what == "fc1-in":
        m.fc1 = torch.nn.Linear(4, 8)
    elif what == "fc2-out":
        m.fc2 = torch.nn.Linear(8, 2)
    elif what == "fc1-bias":
        m.fc1 = torch.nn.Linear(3, 8, bias=False)
    elif what == "fc2-bias":
        m.fc2 = torch.nn.Linear(8, 1, bias=False)
    elif what == "module":
        m = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 1))
    return m


@pytest.mark.parametrize("what", ["own-forward", "fc1-in", "fc2-out", "fc1-bias", "fc2-bias", "module"])
def test_a_classifier_the_kernel_cannot_evaluate_is_refused_by_name(what):
    from treespec_sglang.plugin.rows import _clf_id

    m = _bad(what)
    with pytest.raises(ValueError, match=rf"needs a C2TClassifier \(fc1 3 -> hidden, fc2 hidden -> 1\), "
                                         rf"got {type(m).__name__}$"):
        pool_kernels.classifier_table([_clf_id(m)], "cpu")


@pytest.mark.parametrize("hidden,hb", [(8, 64), (64, 64), (65, 128), (128, 128), (129, 256)])
def test_the_classifier_table_pads_the_hidden_size_to_a_power_of_two_of_at_least_64(hidden, hb):
    from treespec_sglang.plugin.rows import _clf_id

    narrow, m = C2TClassifier(hidden=8), C2TClassifier(hidden=hidden)
    ids = sorted([_clf_id(narrow), _clf_id(m)])
    clf_ids, w, got = pool_kernels.classifier_table(ids, "cpu")
    assert got == hb and w.shape == (2, 6, hb) and w.dtype == torch.float32
    assert clf_ids.dtype == torch.float32 and clf_ids.tolist() == ids
    j = ids.index(_clf_id(m))
    assert torch.equal(w[j, :3, :hidden], m.fc1.weight.t()) and not w[j, :, hidden:].any()


# ------------------------------------------------------------------------------------------ the launch
def _batches(k, S, N, clf):
    """Batches of every kind a round launches: all stages mixed (with SGLang's selection, an extra keep and the
    confidences written out) and each stage alone (without them)."""
    rng = random.Random(k * 100 + N)
    mixed = [random_spec(STAGES[i % len(STAGES)], rng, k, S, N) for i in range(2 * len(STAGES))]
    for s in mixed:
        if s is not None and s.get("beta") is not None:
            s["classifier"] = clf
    out = [(mixed, True)]
    out += [([random_spec(stage, rng, k, S, N) for _ in range(3)], False) for stage in STAGES if stage != "c2t"]
    return out


# pools of 4 / 5 candidates (a power of two and one more: chain mode's topk 1), a single step, N - 1 a power of two
LAUNCH_SHAPES = [(1, 4, 5), (1, 5, 6), (4, 1, 5), (2, 3, 9), (3, 4, 20), (4, 3, 8), (8, 4, 32)]


@pytest.mark.parametrize("k,S,N", LAUNCH_SHAPES)
def test_every_launch_hands_the_kernel_its_signature_and_blocks_that_fit_the_pool(k, S, N, recording):
    """Every launch of every kind of batch passes :meth:`RecordingKernels.check` (SGLang's selection given as int32
    and the extra keep as uint8 too: the kernel takes int64 and bool), so every batch of one shape and classifier
    width is one compiled variant."""
    clf = C2TClassifier(hidden=8)
    P = k + (S - 1) * k * k
    for specs, extras in _batches(k, S, N, clf):
        params = [None if s is None else parse_spec(s) for s in specs]
        bs = len(params)
        pool = make_pool(k, S, bs, seed=N)
        kw = {}
        if extras:
            nat = native_of(pool, N)
            kw = dict(native=(nat[0], nat[1].int(), nat[2]), extra_keep=(torch.rand(bs, P) < 0.1).to(torch.uint8),
                      conf_out=torch.zeros(bs, P))
        select_on_pool_fused(pool, N, params, **kw)
    variants = {}
    for call in recording.calls:
        recording.check(call, k, S, N)
        variants.setdefault((call[2]["HB"], call[2]["WRITE_CONF"]), set()).add(RecordingKernels.variant(call))
    assert len(recording.calls) == len(STAGES)  # the mixed batch, then every stage alone but c2t
    assert all(len(v) == 1 for v in variants.values()), variants


@pytest.mark.parametrize("wide_default", [False, True], ids=["builtin-default", "wide-default"])
@pytest.mark.parametrize("k,S,N", [(2, 3, 6), (4, 3, 8), (8, 4, 32)])
def test_start_compiles_every_variant_a_round_at_the_servers_geometry_launches(k, S, N, wide_default, tmp_path,
                                                                            monkeypatch, recording):
    """Every kernel variant a round at the server's (topk, steps, N) launches, eagerly or replayed in a selection
    graph, for any mix of stages and registered classifiers, is one ``warm_up`` launched at server start: no
    round compiles (a compile stalls every request of its batch). The registry holds a wide classifier beside the
    built-in default, or as the default itself (then no registered classifier has the narrow width a batch
    scoring nothing launches with)."""
    from treespec_sglang.plugin import classifiers
    from treespec_sglang.plugin.rows import _clf_id
    from treespec_sglang.plugin.select_graph import SelectionGraph

    C2TClassifier(hidden=100).save(str(tmp_path / "wide.pt"))
    name = "default" if wide_default else "wide"
    monkeypatch.setenv(classifiers.ENV_CLASSIFIERS, json.dumps({name: str(tmp_path / "wide.pt")}))
    pool_kernels.warm_up("cpu", k, S, N)
    for call in recording.calls:
        recording.check(call, k, S, N)
    warm = {RecordingKernels.variant(c) for c in recording.calls}
    recording.calls.clear()
    clfs = classifiers.registered()
    pool = make_pool(k, S, 2 * len(STAGES), seed=k)
    rng = random.Random(N)
    for named in ([], ["default"], [name], ["default", name]):
        specs = [random_spec(STAGES[i % len(STAGES)], rng, k, S, N) for i in range(2 * len(STAGES))]
        for i, spec in enumerate(specs):
            if spec is not None and spec.get("beta") is not None:  # c2t, an early-stopping chain
                if named:
                    spec["classifier"] = clfs[named[i % len(named)]]
                else:  # a batch that scores nothing
                    specs[i] = {"policy": "eagle2", "budget": N}
        params = [None if s is None else parse_spec(s) for s in specs]
        select_on_pool_fused(pool, N, params, native_of(pool, N))
    ids = sorted(_clf_id(c) for c in clfs.values())
    SelectionGraph((pool.scores, pool.tokens, pool.parent_list), k, N, ids, capture=False)
    rounds = {RecordingKernels.variant(c) for c in recording.calls}
    assert rounds and rounds <= warm, rounds - warm


@pytest.mark.parametrize("k,S", [(2, 3), (3, 4), (4, 2), (8, 5)])
def test_the_first_child_parent_table_is_a_valid_sglang_pool(k, S):
    """Every node's parent one level up, every expanded node a distinct node of its level (its parent's first
    child), the table one entry per parent-table column of SGLang's layout (PoolView reads it)."""
    P = k + (S - 1) * k * k
    parents = first_child_parents(k, S)
    assert len(parents) == 1 + (S - 1) * k
    pool = PoolView.from_flat(torch.rand(1, P) + 0.1, torch.zeros(1, P, dtype=torch.int64),
                              torch.tensor([parents]), k)
    parent, level = pool.parent[0], pool.level
    assert (parent[level == 1] == -1).all() and (level[parent[level > 1]] == level[level > 1] - 1).all()
    for d in range(2, S + 1):
        expanded = parent[level == d].unique()  # the nodes of level d - 1 the beam kept
        assert expanded.numel() == k
        if d > 2:  # each its parent's first child: an offset of a multiple of k into level d - 1's block
            assert ((expanded - (k + (d - 3) * k * k)) % k == 0).all()


# ------------------------------------------------------------------------------------------ inputs
def test_n_minus_1_may_equal_the_pool_and_no_more():
    pool = make_pool(2, 2, 3, seed=0)  # P = 2 + 4 = 6
    params = [None, parse_spec({"policy": "eagle2", "budget": 7}), parse_spec({"policy": "talon", "budget": 5})]
    got = select_on_pool_fused(pool, 7, params)
    ref = select_on_pool(pool, 7, params)
    assert got[1].shape == (3, 6) and all(torch.equal(a, b) for a, b in zip(got[1:], ref[1:]))
    with pytest.raises(ValueError, match=r"num_draft_token - 1 = 7 exceeds the pool's 6 candidates"):
        select_on_pool_fused(pool, 8, params)


@pytest.mark.parametrize("bs", [0, 1, 2])
def test_small_batches_equal_the_torch_selection(bs):
    """Down to one request; an empty batch (an idle rank's, its row table given or not) launches nothing and
    returns outputs of no rows."""
    two = make_pool(4, 3, 2, seed=bs)
    pool = PoolView.from_flat(two.scores[:bs], two.tokens[:bs], two.parent_list[:bs], 4)
    params = [parse_spec({"policy": "talon", "budget": 6}), None][:bs]
    if bs == 0:
        for rows in (torch.zeros(0, len(COLUMNS)), None):
            got = select_on_pool_fused(pool, 8, params, rows=rows)
            assert [t.shape for t in got[1:]] == [(0, 7), (0, 7), (0, 8)]
        assert [t.shape for t in select_on_pool(pool, 8, params)[1:]] == [(0, 7), (0, 7), (0, 8)]
        return
    got, ref = select_on_pool_fused(pool, 8, params), select_on_pool(pool, 8, params)
    assert all(torch.equal(a, b) for a, b in zip(got[1:], ref[1:]))


def test_native_rows_take_sglangs_selection_verbatim_in_any_integer_dtype():
    """SGLang's ``top_scores_index`` for the native rows, whatever order it is in (not the kernel's own ranking);
    int32 selection and a uint8 extra keep give what int64 and bool give."""
    pool = make_pool(4, 3, 3, seed=2)
    params = [None, parse_spec({"policy": "eagle2", "budget": 5}), None]
    own = native_of(pool, 8)
    given = (own[0], own[1].flip(-1).contiguous(), own[2].flip(-1).contiguous())  # SGLang's, listed the other way
    extra = torch.zeros(3, pool.scores.shape[1], dtype=torch.bool)
    extra[1, 0] = True
    got = select_on_pool_fused(pool, 8, params, given, extra_keep=extra)
    assert torch.equal(got[1][[0, 2]], given[1][[0, 2]])
    narrow = select_on_pool_fused(pool, 8, params, (given[0], given[1].int(), given[2]), extra_keep=extra.to(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(got[1:], narrow[1:]))


def test_params_and_rows_must_have_one_entry_per_pool_row():
    pool = make_pool(2, 3, 2, seed=1)
    one = parse_spec({"policy": "eagle2", "budget": 4})
    with pytest.raises(ValueError, match=r"3 params and 3 rows for a pool of 2 rows"):
        select_on_pool_fused(pool, 6, [one] * 3)
    with pytest.raises(ValueError, match=r"2 params and 1 rows for a pool of 2 rows"):
        select_on_pool_fused(pool, 6, [one] * 2, rows=policy_rows([one], "cpu"))
