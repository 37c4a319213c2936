"""The per-request pool selection as one fused Triton launch (no sglang import; triton optional).

:func:`select_on_pool_fused` returns exactly what :func:`.pool.select_on_pool` (the torch implementation, and
the oracle) returns, from one kernel launch with one program per request row (:mod:`.pool_kernels_triton`):
SGLang's ranking and the rows' ``top`` (native rows, ``none``, EAGLE-2, SALF with th = 0), TALON (App. A
Alg. 2), C2T (App. A Alg. 1 with the classifier of Eq. 6-8 evaluated in the kernel), the chain with or
without C2T's early stop, SALF's best-first search (Alg. 2), in any mix within the batch, then the padding
to N-1 with SGLang's next best nodes and the verify layout. Each row's rule is chosen in the kernel from its
``kind`` column through a kind -> stage table built once from the registry (:func:`stage_table`); every
distinct classifier of a batch is a slice of one stacked weight table (:func:`classifier_table`, built once
per classifier set) and each row takes its own by its ``clf`` column. A policy registered with a
``"custom"`` pool rule keeps its own Python ``keep``: the host computes it as :func:`.pool.select_on_pool`
does and the kernel ORs it in before the padding.

Per round the host reads ``params`` (Python objects) only for what the torch path reads: which stages and
classifiers the batch has, whether SGLang's ranking is depth-masked, and SALF's static pop bound; those are
runtime ints of the launch (no recompile when they change), pool geometry (k, S, P, N) is compile-time.
Nothing is read back from the device, outputs are ``torch.empty`` of fixed shapes and the tables are cached
on the device, so the launch can be captured in a CUDA graph once a first call has built the tables and compiled
the kernel for the pool's shape (:func:`warm_up` does that at server start). The classifier's hidden size is
compile-time too (``HB``): a classifier of another width compiles once more when a batch first uses it.

Agreement: every output is bit-identical to the torch path's except where float32 evaluation order may
legitimately differ: the C2T confidence (``exp`` of the path value, the parent's entropy with its ``exp``
and sum, the 3 -> hidden -> 1 MLP's sums, the sigmoid: within a few ulps of torch's) and SALF's popped mass
(``exp(val)`` summed over D, Alg. 2 line 13). A decision can differ only where a confidence sits within
that error of beta or of another candidate's confidence, or a popped mass of th. NaN scores rank first in
SGLang's ranking, as in ``torch.sort``. A custom pool rule is the policy's own torch ``keep``, run by the
host exactly as ``select_on_pool`` runs it.

CPU tensors (and ``TRITON_INTERPRET=1``) run the same source in Triton's interpreter: triton reads the mode
when ``@triton.jit`` decorates, so the source module is loaded once per mode under a name of its own
(:func:`kernels`), whatever mode triton was imported in.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Dict, Optional, Sequence

import torch

from ..policies.classifier import C2TClassifier
from ..policies.params import PolicyParams
from ..policies.registry import REGISTRY
from ..utils.bounded import Bounded
from ..utils.syncs import to_device
from .pool import BatchPlan, PoolView, _Classifiers, first_child_parents
from .rows import _clf_id, policy_rows
from .pool_rules import salf_pops, static

__all__ = ["select_on_pool_fused", "kernels", "interpreted", "warm_up", "stage_table", "classifier_table", "launch",
           "graph_args", "workspace", "grown_rows", "no_classifier",
           "STAGE_CODES", "FLAGS"]

# the kernel's stage codes (registry.STAGES) and the bits of its per-launch ``flags``
STAGE_CODES = {"rank": 0, "talon": 1, "c2t": 2, "chain": 3, "salf": 4, "custom": 5}
FLAGS = {"talon": 1, "c2t": 2, "chain": 4, "salf": 8, "conf": 16, "mask_depth": 32, "native": 64, "extra": 128}
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pool_kernels_triton.py")
_KERNELS: Dict[bool, object] = {}  # interpret? -> the loaded source module
_STAGE_TABLES: Dict[tuple, torch.Tensor] = {}
_CLF_TABLES: Dict[tuple, tuple] = Bounded(256)  # one entry per classifier set a batch used


def kernels(interpret: bool):
    """The kernel source module decorated for ``interpret`` (Triton's interpreter) or compiled, loaded once.

    Raises
    ------
    RuntimeError
        When triton (or the part of ``triton.language`` the kernels use) cannot be imported, or compiled
        kernels are asked for in a process that imported triton in interpreter mode.
    """
    mod = _KERNELS.get(interpret)
    if mod is not None:
        return mod
    try:
        import triton
    except ImportError as e:
        raise RuntimeError(f"select_on_pool_fused needs the 'triton' package, which cannot be imported here "
                           f"({type(e).__name__}: {e}); install triton, or use pool.select_on_pool (the same "
                           f"selection in torch)") from None
    name = f"{__name__}_triton_{'interpret' if interpret else 'jit'}"
    spec = importlib.util.spec_from_file_location(name, _SOURCE)
    mod = importlib.util.module_from_spec(spec)
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # the mode is read when @triton.jit decorates: set it for this load only
        with knobs.runtime.scope():
            knobs.runtime.interpret = interpret
            spec.loader.exec_module(mod)
    else:  # older triton reads the environment
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            spec.loader.exec_module(mod)
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old
    if mod.IMPORT_ERROR is not None:
        raise RuntimeError(f"select_on_pool_fused: this triton lacks what the kernels use ({mod.IMPORT_ERROR})")
    if not interpret and type(mod._sum_combine).__name__ == "InterpretedFunction":
        raise RuntimeError("select_on_pool_fused: triton was imported with TRITON_INTERPRET=1, so this process "
                           "cannot compile kernels (its own library is interpreted); run without it for the GPU")
    _KERNELS[interpret] = mod
    return mod


def interpreted(device) -> bool:
    """Whether a pool on ``device`` runs the kernels in Triton's interpreter: off CUDA, or with
    ``TRITON_INTERPRET`` set (then compiled kernels cannot be built in this process anyway)."""
    return torch.device(device).type != "cuda" or os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def warm_up(device, topk: int, steps: int, num_draft_tokens: int) -> None:
    """Launches on a 2-row pool of the server's shape (an EAGLE-2 and a C2T row), so the kernel is loaded and
    compiled for that geometry at server start, not in the first round that needs it (a compile failure then
    stops the start with its reason): one per classifier width the server's registered classifiers need (the
    table's padded hidden size ``HB`` is compile-time), so a request naming any of them never compiles
    mid-serving, where a compile stalls every request of the batch."""
    from ..policies import parse_spec
    from .classifiers import registered

    kernels(interpreted(device))  # first: a missing triton is named before any device work
    k, S, N = topk, steps, num_draft_tokens
    P, g = k + (S - 1) * k * k, torch.Generator().manual_seed(0)
    scores = torch.rand(2, P, generator=g) * 0.5 + 0.25
    pool = PoolView.from_flat(scores.to(device), torch.zeros(2, P, dtype=torch.int64, device=device),
                              torch.tensor([first_child_parents(k, S)] * 2, device=device), k)
    widths = set()
    for name, clf in sorted(registered().items()):  # ``default`` among them: what a request naming none takes
        hb = classifier_table([_clf_id(clf)], device)[2]
        if hb not in widths:
            widths.add(hb)
            params = [parse_spec({"policy": "eagle2", "budget": N}),
                      parse_spec({"policy": "c2t", "budget": N, "classifier": clf})]
            select_on_pool_fused(pool, N, params)
    if 64 not in widths:  # a batch naming no classifier launches with no_classifier's width
        select_on_pool_fused(pool, N, [parse_spec({"policy": "eagle2", "budget": N})] * 2)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def stage_table(device) -> torch.Tensor:
    """``[1 + len(REGISTRY)]`` int32 on ``device``: a row's ``kind`` (:func:`.pool.kind_id`) -> its stage code
    (:data:`STAGE_CODES`; native 0, a policy without a pool rule -1). Built once per registry content."""
    regs = tuple((n, None if r.pool_rule is None else r.pool_rule.stage) for n, r in REGISTRY.items())
    key = (regs, str(torch.device(device)))
    table = _STAGE_TABLES.get(key)
    if table is None:
        codes = [STAGE_CODES["rank"]] + [-1 if st is None else STAGE_CODES[st] for _, st in regs]
        table = _STAGE_TABLES[key] = to_device(torch.tensor(codes, dtype=torch.int32), device)
    return table


def classifier_table(ids: Sequence[int], device):
    """The classifiers numbered ``ids`` (ascending, the rows' ``clf`` values) stacked for the kernel, built once
    per set from the same device copies :mod:`.pool` scores with.

    Returns ``(ids [n] float32, weights [n, 6, HB] float32, HB)``: per classifier fc1's weight columns 0-2,
    fc1's bias, fc2's weights (hidden padded with zeros to HB, a power of two >= 64) and fc2's bias at [5, 0].
    """
    key = (tuple(ids), str(torch.device(device)))
    hit = _CLF_TABLES.get(key)
    if hit is not None:
        return hit
    mods = [m for _, m in _Classifiers(list(ids), None, device).mods]
    for m in mods:
        if not (isinstance(m, C2TClassifier) and type(m).forward is C2TClassifier.forward
                and m.fc1.in_features == 3 and m.fc2.out_features == 1 and m.fc1.bias is not None
                and m.fc2.bias is not None):
            raise ValueError(f"select_on_pool_fused evaluates C2T's classifier in the kernel: it needs a "
                             f"C2TClassifier (fc1 3 -> hidden, fc2 hidden -> 1), got {type(m).__name__}")
    hb = max(64, 1 << (max(m.fc1.out_features for m in mods) - 1).bit_length())
    w = torch.zeros(len(mods), 6, hb, dtype=torch.float32, device=device)
    with torch.no_grad():
        for j, m in enumerate(mods):
            h = m.fc1.out_features
            w[j, :3, :h] = m.fc1.weight.float().t()
            w[j, 3, :h] = m.fc1.bias.float()
            w[j, 4, :h] = m.fc2.weight.float()[0]
            w[j, 5, 0] = m.fc2.bias.float()[0]
    return _CLF_TABLES.put(key, (to_device(torch.tensor(list(ids), dtype=torch.float32), device), w, hb))


def _dummy(dtype, device) -> torch.Tensor:
    return static(("pool_kernels.dummy", dtype), device, lambda: torch.zeros(1, dtype=dtype))


def _launch_plan(params: Sequence[Optional[PolicyParams]], N: int, S: int, P: int) -> dict:
    """The launch's runtime ints from :class:`.pool.BatchPlan` (what the torch path reads of ``params``): the stage
    and option flags, the classifier ids, the custom policies and SALF's bounds (pops, B, G's N-th best)."""
    plan = BatchPlan.of(params, N, S)
    flags = sum(FLAGS[s] for s in ("talon", "c2t", "chain") if s in plan.stages)
    flags |= (FLAGS["conf"] if plan.clf_ids else 0) | (FLAGS["mask_depth"] if plan.mask_depth else 0)
    pops = b_max = kth = 1
    if plan.salf is not None:
        pops, n_max, b_max = plan.salf
        flags |= FLAGS["salf"]
        b_max, kth = max(1, min(P, b_max)), min(max(n_max - 1, 1), P)  # as pool_rules.salf_keep bounds them
    return dict(plan=plan, flags=flags, pops=pops, b_max=b_max, kth=kth)


def graph_args(N: int, S: int, P: int, scored: bool) -> dict:
    """Runtime ints that serve any batch (a launch captured once per shape, :mod:`.select_graph`): every stage
    and option on (a row runs only its own stage; a depth mask of ``rank_depth`` = unbounded masks nothing),
    SGLang's selection and an extra keep always read, SALF's bounds at their caps (pops ``2N + 2``, the paper's
    bound of :func:`.pool_rules.salf_pops`; B <= P; G's (N-1)-th best). ``scored``: the launch has a classifier
    table (C2T confidences are computed only with one). The trees equal those of :func:`_launch_plan`'s ints:
    the tests check it on random mixed batches."""
    flags = sum(FLAGS.values()) - (0 if scored else FLAGS["conf"])
    return dict(flags=flags, pops=salf_pops(0.0, N, S), b_max=P, kth=min(max(N - 1, 1), P))


def launch(mod, pool: PoolView, rows: torch.Tensor, stages: torch.Tensor, clf: tuple, native: torch.Tensor,
           extra: torch.Tensor, out: tuple, args: dict, conf_out: Optional[torch.Tensor] = None) -> None:
    """One launch of the kernel (grid: the pool's rows) into ``out``; no allocation, nothing read back.

    ``rows`` ``[bs, F]`` float32; ``stages`` :func:`stage_table`; ``clf`` ``(ids [n] float32, weights [n, 6, HB],
    HB)`` (:func:`classifier_table`, or stand-ins with ``n_clf`` unused); ``native`` ``[bs, N-1]`` int64 and
    ``extra`` ``[bs, P]`` bool (read when ``args["flags"]`` says so); ``out`` ``(top [bs, N-1] int64, tokens
    [bs, N-1], keep [bs, N] bool, work [bs, N_WORK * BLOCK_P] int32, workf [bs, N_WORKF * BLOCK_P] float32)``;
    ``args`` ``flags`` / ``pops`` / ``b_max`` / ``kth`` (:func:`_launch_plan`, :func:`graph_args`). Every tensor
    but the pool's contiguous (the kernel indexes rows by their width)."""
    bs, P = pool.scores.shape
    k, S, N = pool.k, pool.steps, out[0].shape[1] + 1
    top, toks, keep, work, workf = out
    block_p = 1 << (P - 1).bit_length()
    clf_ids, clf_w, hb = clf
    mod.pool_select_kernel[(bs,)](
        pool.scores.contiguous(), pool.val.contiguous(), pool.parent.contiguous(), pool.tokens.contiguous(), rows,
        stages, clf_ids, clf_w, native, extra, top, toks, keep, conf_out if conf_out is not None else workf, work,
        workf,
        stages.numel(), clf_ids.numel(), args["flags"], args["pops"], args["b_max"], args["kth"],
        F=rows.shape[1], K=k, S=S, P=P, N=N, BLOCK_P=block_p, BLOCK_W=1 << (k * k - 1).bit_length(),
        BLOCK_K=1 << (k - 1).bit_length(), BLOCK_N=1 << (N - 1).bit_length(), HB=hb,
        CHUNK=min(block_p, 32), WRITE_CONF=conf_out is not None, num_warps=warps(block_p))


def warps(block_p: int) -> int:
    """Warps per row program: one pool lane per thread up to 8 warps (a 64-lane pool on 2 warps, not 4 with
    lanes held twice; 256 lanes on 8, where 4 spilled registers on sm_90: ``tests/plugin/test_kernel_compile.py``)."""
    return max(1, min(8, block_p // 32))


def workspace(mod, bs: int, P: int, dev) -> tuple:
    """``(work [bs, N_WORK * BLOCK_P] int32, workf [bs, N_WORKF * BLOCK_P] float32)``: the kernel's scratch."""
    block_p = 1 << (P - 1).bit_length()
    return (torch.empty(bs, mod.N_WORK * block_p, dtype=torch.int32, device=dev),
            torch.empty(bs, mod.N_WORKF * block_p, dtype=torch.float32, device=dev))


def no_classifier(dev) -> tuple:
    """``classifier_table``'s stand-in for a launch without confidences (never read)."""
    return _dummy(torch.float32, dev), _dummy(torch.float32, dev), 64


def select_on_pool_fused(pool: PoolView, num_draft_token: int, params: Sequence[Optional[PolicyParams]], native=None,
                         rows: Optional[torch.Tensor] = None, *, extra_keep: Optional[torch.Tensor] = None,
                         conf_out: Optional[torch.Tensor] = None):
    """:func:`.pool.select_on_pool` as one Triton launch; the same arguments and the same result.

    Parameters
    ----------
    pool, num_draft_token, params, native, rows : as :func:`.pool.select_on_pool` (``rows`` ``[bs, F]`` float32).
    extra_keep : optional ``[bs, P]`` bool, OR'ed into every policy row's keep before the padding (with the
        custom rows' own keep, which is computed here as the torch path computes it); native rows take
        ``native`` verbatim when it is given.
    conf_out : optional ``[bs, P]`` float32 contiguous, which the kernel fills with the C2T confidence of every
        pool node of the c2t / chain rows when the batch scores any (to compare with the torch classifier; its
        other entries are left as given).

    Returns
    -------
    (parent_list, top_scores_index ``[bs, N-1]`` int64, draft_tokens ``[bs, N-1]``, keep ``[bs, N]`` bool)

    Raises
    ------
    RuntimeError
        Without triton. ValueError: ``N - 1`` exceeds the pool, ``params`` or ``rows`` do not have one entry per
        pool row, or a classifier is no C2TClassifier.
    """
    N = num_draft_token
    bs, P = pool.scores.shape
    S, dev = pool.steps, pool.scores.device
    if N - 1 > P:
        raise ValueError(f"num_draft_token - 1 = {N - 1} exceeds the pool's {P} candidates (SGLang needs N - 1 <= P)")
    mod = kernels(interpreted(dev))
    if rows is None:
        rows = policy_rows(params, dev)
    if rows.shape[0] != bs or len(params) != bs:  # the kernel reads row b of each for the pool's row b
        raise ValueError(f"select_on_pool_fused: {len(params)} params and {rows.shape[0]} rows for a pool of {bs} "
                         f"rows (one of each per request row)")
    args = _launch_plan(params, N, S, P)
    plan, flags = args["plan"], args["flags"]
    custom = plan.custom_keep(pool, rows, N)  # as select_on_pool
    if custom is not None:
        extra_keep = custom if extra_keep is None else extra_keep | custom
    top = torch.empty(bs, N - 1, dtype=torch.int64, device=dev)
    toks = torch.empty(bs, N - 1, dtype=pool.tokens.dtype, device=dev)
    keep = torch.empty(bs, N, dtype=torch.bool, device=dev)
    if bs == 0:
        return pool.parent_list, top, toks, keep
    stages = stage_table(dev)
    # absent inputs: cached stand-ins of the right dtype (never read), so the kernel's signature stays the same
    clf = classifier_table(plan.clf_ids, dev) if plan.clf_ids else no_classifier(dev)
    nat, extra = _dummy(torch.int64, dev), _dummy(torch.bool, dev)
    if native is not None and "native" in plan.stages:
        nat, flags = native[1].to(torch.int64).contiguous(), flags | FLAGS["native"]
    if extra_keep is not None:
        extra, flags = extra_keep.to(torch.bool).contiguous(), flags | FLAGS["extra"]
    launch(mod, pool, rows.contiguous(), stages, clf, nat, extra, (top, toks, keep) + workspace(mod, bs, P, dev),
           dict(args, flags=flags), conf_out)
    return pool.parent_list, top, toks, keep


def grown_rows(have: Optional[int], need: int) -> int:
    """The rows a shared scratch buffer of ``have`` rows (None: none yet) is reallocated with when a batch of ``need``
    rows does not fit: ``need``, or twice the old buffer, the more (a batch growing one request at a time
    reallocates log2(bs) times, and the memory stays under twice the largest batch)."""
    return need if have is None else max(need, 2 * have)
