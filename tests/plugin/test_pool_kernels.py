"""The fused Triton pool selection against the torch one (``select_on_pool``, the oracle), output by output.

CPU tensors run the kernel in Triton's interpreter: ``pool_kernels.kernels`` loads the kernel source once per
mode with the mode set for that load only, so these tests need no ``TRITON_INTERPRET`` in the environment and
are unaffected by which test imported triton (or the module) first. With CUDA the mixed batches also run compiled.

Every output is compared bit for bit, with one documented exception: the C2T confidence, which the kernel
evaluates itself (``exp`` in the features, the top-k entropy's sum, the 3 -> hidden -> 1 MLP's sums, the
sigmoid) in a float32 order of its own. It is compared to torch's directly within ``CONF_TOL`` (observed: at
most 1.2e-7, one ulp), and the selection is checked twice: exactly against ``select_on_pool`` fed the kernel's
own confidences (every case, ties included: neither implementation reproduces exact confidence ties, since MKL
and numpy sum identical rows in different orders), and exactly against plain ``select_on_pool`` on cases
whose C2T decisions are asserted clear: every confidence more than ``CONF_TOL`` from beta, and the confidences
C2T ranks in each level in the same order in both implementations (confidences of the lowest-probability
siblings can sit one ulp apart, and are never ranked).
SALF's popped mass (``exp(val)`` summed over D) may round differently too; the cases' th values are not
within float32 error of any mass they reach (dyadic masses in the tie pools; continuous masses elsewhere).
"""

import importlib
import random
import sys
from dataclasses import dataclass

import pytest
import torch

from tests.plugin.kernel_cases import (CONF_TOL, DEVICES, KERNEL_INTS, KERNEL_POINTERS, OTHER, SHAPES, STAGES, THIRD,
                                       compiled_triton, make_pool, native_of, random_spec, run_both, torch_conf)
from treespec_sglang.plugin.pool import COLUMNS, PoolView, policy_rows
from treespec_sglang.policies import parse_spec, registry

pytest.importorskip("triton")
from treespec_sglang.plugin.pool_kernels import kernels, select_on_pool_fused  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("given", [False, True], ids=["native=None", "native"])
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("k,S,N", SHAPES)
def test_mixed_batches_equal_the_torch_selection(k, S, N, seed, given, device):
    """Every stage in one batch (native rows included), random parameters, two pools per shape."""
    rng = random.Random(1000 * k + 100 * S + seed)
    stages = STAGES + rng.choices(STAGES, k=3)
    rng.shuffle(stages)
    pool = make_pool(k, S, len(stages), seed=rng.randint(0, 10 ** 6), device=device)
    params = [None if s is None else parse_spec(s) for s in (random_spec(st, rng, k, S, N) for st in stages)]
    run_both(pool, N, params, native_of(pool, N) if given else None)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("k,S,N", [SHAPES[1], SHAPES[3]])
def test_each_stage_alone(k, S, N, stage):
    rng = random.Random(100 * STAGES.index(stage) + 10 * k + S)
    pool = make_pool(k, S, 6, seed=k + S + len(stage))
    params = [None if s is None else parse_spec(s) for s in (random_spec(stage, rng, k, S, N) for _ in range(6))]
    run_both(pool, N, params, native_of(pool, N) if stage == "native" else None)


@pytest.mark.parametrize("kind", ["ties", "invalid"])
@pytest.mark.parametrize("k,S,N", SHAPES)
def test_ties_and_invalid_children(k, S, N, kind):
    """Equal scores across siblings and levels (ties go to the lower flat index everywhere), and zero, negative,
    -inf and NaN scores (never a policy's candidate; NaN first in SGLang's descending ranking, as torch.sort)."""
    rng = random.Random(7 * k + S)
    pool = make_pool(k, S, 14, seed=3 * k + S, kind=kind)
    params = [None if s is None else parse_spec(s) for s in
              (random_spec(STAGES[i % len(STAGES)], rng, k, S, N) for i in range(14))]
    run_both(pool, N, params, native_of(pool, N) if kind == "invalid" else None, margins=kind == "invalid")


EDGE_SPECS = [  # (k, S, N, specs)
    (4, 3, 8, [{"policy": "talon", "budget": 1}, {"policy": "c2t", "budget": 1}, {"policy": "salf", "budget": 1},
               {"policy": "eagle2", "budget": 1}, {"policy": "chain", "length": 0}]),
    (4, 3, 8, [{"policy": "talon", "budget": 50, "topk": 9}, {"policy": "c2t", "budget": 50, "topk": 9, "beta": .3},
               {"policy": "salf", "budget": 50, "th": 0.3}, {"policy": "eagle2", "budget": 50}]),
    (4, 5, 16, [{"policy": "salf", "budget": 16, "batch": 1, "th": 0.02}, {"policy": "salf", "budget": 9, "th": 0.01},
                {"policy": "salf", "budget": 12, "batch": 3, "th": 0.0}, {"policy": "salf", "budget": 7, "th": 0.0,
                                                                          "max_depth": 2}]),
    (4, 5, 16, [{"policy": "chain", "length": 1}, {"policy": "chain", "length": 1, "beta": 0.5},
                {"policy": "c2t", "budget": 12, "topk": 4, "beta": 0.3, "max_depth": 2},
                {"policy": "c2t", "budget": 12, "topk": 2, "beta": 0.3, "max_depth": 1}]),
    (8, 4, 32, [{"policy": "c2t", "budget": 20, "topk": 6, "beta": 0.3, "classifier": c} for c in (None, OTHER, THIRD)]
     + [{"policy": "chain", "length": 4, "beta": 0.5, "classifier": OTHER}, {"policy": "talon", "budget": 20}]),
]


@pytest.mark.parametrize("k,S,N,specs", EDGE_SPECS, ids=["budget1", "budget>N", "salf", "chain1-c2t-depth", "clfs"])
def test_edge_parameters(k, S, N, specs):
    """Budget 1 and budgets over N, SALF with many pops (small th) and th 0 (with a depth limit), chains of one
    token with and without the early stop, C2T with max_depth < S, three classifiers in one batch."""
    pool = make_pool(k, S, len(specs), seed=k * S)
    run_both(pool, N, [parse_spec(s) for s in specs])


def test_salf_mass_equal_to_th_and_rows_given_apart_from_params():
    """SALF continues at a popped mass exactly th (1.0, exact in float32), and the row table's values decide
    when ``rows`` is given (``params`` only name the rules): a talon row of budget 4 in the table."""
    scores = torch.tensor([[1.0, 0.0, 0.5, 0.25, 0.0, 0.0]] * 2)
    pool = PoolView.from_flat(scores, torch.arange(12).view(2, 6), torch.tensor([[-1, 0, 1]] * 2), 2)
    got = run_both(pool, 4, [parse_spec({"policy": "salf", "budget": 4, "batch": 1, "th": t}) for t in (1.0, 0.9)])
    assert got[1].tolist() == [[0, 2, 3]] * 2 and got[3].tolist() == [[True, True, True, False]] * 2
    pool = make_pool(4, 3, 3, seed=5)
    talon = parse_spec({"policy": "talon", "budget": 20, "topk": 4, "mu": 0.01})
    small = parse_spec({"policy": "talon", "budget": 4, "topk": 4, "mu": 0.01})
    got = run_both(pool, 8, [None, talon, None], native_of(pool, 8), policy_rows([None, small, None], "cpu"))
    assert int(got[3][1].sum()) == 4


@dataclass(frozen=True)
class _AboveMeanParams(registry.REGISTRY["eagle2"].Params):
    pass


def _above_mean_keep(pool, rows, n_eff):
    """The root's children above their mean path value (ancestor-closed: level 1 only)."""
    k = pool.k
    first = pool.val[:, :k]
    mean = torch.where(pool.valid[:, :k], first, 0.0).sum(-1, keepdim=True) / k
    return torch.cat([pool.valid[:, :k] & (first > mean), torch.zeros_like(pool.valid[:, k:])], 1)


@pytest.fixture
def custom_policy(fresh_registry):
    """A policy with a "custom" pool rule, registered for one test, then removed (the registry is process-wide)."""
    base = registry.REGISTRY["eagle2"].engine
    cls = type("AboveMeanPolicy", (base,), {"name": "fused-above-mean", "Params": _AboveMeanParams,
                                            "pool_rule": registry.PoolRule(row=lambda p: {}, stage="custom",
                                                                           keep=_above_mean_keep)})
    registry.register_policy(cls)


def test_custom_rows_take_their_registered_keep(custom_policy):
    pool = make_pool(4, 3, 5, seed=9)
    mine = parse_spec({"policy": "fused-above-mean", "budget": 5})
    params = [mine, parse_spec({"policy": "talon", "budget": 8}), None, mine,
              parse_spec({"policy": "salf", "budget": 6, "th": 0.1})]
    got = run_both(pool, 8, params, native_of(pool, 8))
    extra = torch.zeros(5, pool.scores.shape[1], dtype=torch.bool)
    extra[:, 5] = True  # an explicit extra_keep is OR'ed in too: flat 5 (a level-2 node) kept in every row
    more = select_on_pool_fused(pool, 8, params, extra_keep=extra)
    at = more[1] == 5
    assert at.any(-1).all() and more[3][:, 1:][at].all() and not torch.equal(more[3], got[3])


@pytest.mark.parametrize("k,S", [(2, 3), (8, 4)])
def test_kernel_confidences_match_the_torch_classifier(k, S):
    """The in-kernel C2T confidence (C2T Eq. 6-8) against torch's, both classifiers, every pool node."""
    pool = make_pool(k, S, 4, seed=11)
    params = [parse_spec({"policy": "c2t", "budget": 9, "beta": 0.5, "classifier": c}) for c in (None, OTHER)] * 2
    rows = policy_rows(params, "cpu")
    kconf = torch.full(pool.scores.shape, float("nan"))
    select_on_pool_fused(pool, 8, params, conf_out=kconf)
    assert (kconf - torch_conf(pool, params, rows)).abs().max() <= CONF_TOL


def test_steady_state_reads_nothing_back_and_its_op_count_does_not_grow_with_the_batch():
    """Rows and tables built (second call): no host read, no host->device list copy, the same ATen ops at bs 7
    and 21 (on the CPU these include the interpreter's own argument plumbing; on CUDA it is one launch)."""
    from treespec_sglang.utils.syncs import count_ops

    counts = []
    for bs in (7, 21):
        rng = random.Random(3)
        pool = make_pool(4, 3, bs, seed=1)
        params = [None if s is None else parse_spec(s) for s in
                  (random_spec(STAGES[i % len(STAGES)], rng, 4, 3, 8) for i in range(bs))]
        rows, native = policy_rows(params, "cpu"), native_of(pool, 8)
        first = select_on_pool_fused(pool, 8, params, native, rows)
        with count_ops() as c:
            again = select_on_pool_fused(pool, 8, params, native, rows)
        assert (c.reads, c.copies) == (0, 0), c.names
        assert all(torch.equal(x, y) for x, y in zip(first[1:], again[1:]))
        counts.append(c.ops)
    assert counts[0] == counts[1], counts


def test_kernels_load_per_mode_whatever_triton_was_imported_as():
    import triton
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    before = triton.knobs.runtime.interpret
    assert isinstance(kernels(True).pool_select_kernel, InterpretedFunction)
    if compiled_triton():
        assert isinstance(kernels(False).pool_select_kernel, JITFunction)
    else:  # TRITON_INTERPRET=1 when triton was imported: its own library is interpreted, no compiled kernel here
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            kernels(False)
    assert kernels(True) is kernels(True) and triton.knobs.runtime.interpret == before


def test_the_kernel_compiles_for_an_h100():
    """The compiled path (not run without a GPU): the kernel source compiles to sm_90 machine code."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pytest.importorskip("triton.backends.nvidia")
    if not compiled_triton():
        pytest.skip("triton was imported with TRITON_INTERPRET=1: nothing compiles in this process")
    ptr = {torch.float32: "*fp32", torch.int64: "*i64", torch.int32: "*i32", torch.bool: "*i1"}
    sig = {name: ptr[dtype] for name, dtype in KERNEL_POINTERS} | {name: "i32" for name in KERNEL_INTS}
    const = dict(F=len(COLUMNS), K=8, S=4, P=200, N=32, BLOCK_P=256, BLOCK_W=64, BLOCK_K=8, BLOCK_N=32, HB=64,
                 CHUNK=32, WRITE_CONF=False)
    sig.update({c: "constexpr" for c in const})
    src = ASTSource(kernels(False).pool_select_kernel, signature=sig, constexprs=const)
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


def test_without_triton_the_module_imports_and_the_call_names_what_is_missing(monkeypatch):
    import treespec_sglang.plugin as package

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    for name in ("pool_kernels", "pool_kernels_triton"):  # fresh imports; afterwards the originals (or nothing)
        monkeypatch.setitem(sys.modules, f"{package.__name__}.{name}", None)
        del sys.modules[f"{package.__name__}.{name}"]
        monkeypatch.setattr(package, name, getattr(package, name, None), raising=False)
    mod = importlib.import_module("treespec_sglang.plugin.pool_kernels")
    src = importlib.import_module("treespec_sglang.plugin.pool_kernels_triton")
    assert src.IMPORT_ERROR is not None and callable(src.pool_select_kernel)
    pool = make_pool(2, 3, 1, seed=0)
    with pytest.raises(RuntimeError, match=r"needs the 'triton' package, which cannot be imported here "
                                           r"\(ModuleNotFoundError: import of triton halted"):
        mod.select_on_pool_fused(pool, 6, [None])


def test_start_compiles_every_classifier_width_the_server_registered(tmp_path, monkeypatch):
    """``warm_up`` launches once per padded hidden size (``HB``, compile-time) among the registered classifiers,
    ``default`` included, so no request naming one compiles mid-serving; each launch really runs (interpreter)."""
    import json

    from treespec_sglang.plugin import classifiers, pool_kernels
    from treespec_sglang.policies.classifier import C2TClassifier

    files = {}
    for name, hidden in (("narrow", 8), ("wide", 100), ("wide2", 120), ("widest", 200)):
        files[name] = str(tmp_path / f"{name}.pt")
        C2TClassifier(hidden=hidden).save(files[name])
    monkeypatch.setenv(classifiers.ENV_CLASSIFIERS, json.dumps(files))
    widths, launch = [], pool_kernels.launch
    monkeypatch.setattr(pool_kernels, "launch", lambda *a, **k: widths.append(a[4][2]) or launch(*a, **k))
    pool_kernels.warm_up("cpu", 2, 3, 6)
    default_hb = max(64, 1 << (classifiers.registered()["default"].fc1.out_features - 1).bit_length())
    assert sorted(widths) == sorted({default_hb, 64, 128, 256})  # wide and wide2 share 128: one launch
    # every registered classifier wider than 64 ("default" too): a batch naming none still compiles nothing
    files = {"default": files["widest"], "wide": files["wide"]}
    monkeypatch.setenv(classifiers.ENV_CLASSIFIERS, json.dumps(files))
    widths.clear()
    pool_kernels.warm_up("cpu", 2, 3, 6)
    assert sorted(widths) == [64, 128, 256]
