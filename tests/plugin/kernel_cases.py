"""Shared by the fused selection's tests (the kernel, its captured launch): SGLang-shaped pools (random, ties,
invalid children), random requests of every stage, and the kernel run against ``select_on_pool`` (the oracle)
output by output (:func:`run_both`; ``test_pool_kernels``' docstring says what is exact and what is within
``CONF_TOL``)."""

from unittest import mock

import pytest
import torch

from treespec_sglang.plugin import pool as pool_module
from treespec_sglang.plugin import rows as rows_module
from treespec_sglang.plugin.pool import COLUMNS, PoolView, policy_rows, select_on_pool
from treespec_sglang.plugin.pool_rules import level_slices, parent_entropy
from treespec_sglang.policies.classifier import C2TClassifier, c2t_features


CONF_TOL = 1e-5  # |kernel - torch| confidence bound; decisions closer than this to a threshold are float order
# the CPU (Triton's interpreter) and CUDA (compiled; marked gpu, so `pytest -m gpu` runs them on a GPU machine)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
SHAPES = [(2, 3, 6), (4, 3, 8), (4, 5, 16), (8, 4, 32)]  # (topk k, steps S, N)
# the selection kernel's arguments in order (``pool_kernels_triton.pool_select_kernel``): each pointer with the dtype
# it takes, then the runtime ints (``do_not_specialize``)
KERNEL_POINTERS = [("scores_ptr", torch.float32), ("val_ptr", torch.float32), ("parent_ptr", torch.int64),
                   ("tokens_ptr", torch.int64), ("rows_ptr", torch.float32), ("stage_ptr", torch.int32),
                   ("clf_ids_ptr", torch.float32), ("clf_w_ptr", torch.float32), ("native_ptr", torch.int64),
                   ("extra_ptr", torch.bool), ("top_ptr", torch.int64), ("tok_ptr", torch.int64),
                   ("keep_ptr", torch.bool), ("conf_ptr", torch.float32), ("work_ptr", torch.int32),
                   ("workf_ptr", torch.float32)]
KERNEL_INTS = ("n_kinds", "n_clf", "flags", "pops", "b_max", "kth")


def _classifier(hidden, seed):
    g = torch.Generator().manual_seed(seed)
    m = C2TClassifier(hidden=hidden).eval()
    with torch.no_grad():
        for prm in m.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g))
    return m


OTHER = _classifier(8, 1)
THIRD = _classifier(16, 2)


def make_pool(k, S, bs, seed, kind="random", device="cpu"):
    """An SGLang-shaped pool: each node's children hold its score times a top-k conditional distribution, the
    beam expands each level's k best. ``kind``: "random" (softmax over 16 tokens), "ties" (conditionals from
    {1/2, 1/4, 1/8, 1/16}: equal scores across siblings and levels, exact in float32) or "invalid" (random, with
    zero-probability children and some scores made negative, -inf or NaN)."""
    g = torch.Generator().manual_seed(seed)
    P = k + (S - 1) * k * k
    scores, plists = torch.zeros(bs, P), []

    def cond():
        if kind == "ties":
            return sorted((2.0 ** -int(torch.randint(1, 5, (1,), generator=g)) for _ in range(k)), reverse=True)
        p = torch.softmax(torch.randn(16, generator=g) * float(torch.rand(1, generator=g) * 4 + 0.5), 0).topk(k).values
        if kind == "invalid":
            p = torch.where(torch.rand(k, generator=g) < 0.2, 0.0, p)
        return p.tolist()

    for b in range(bs):
        sc, plist = [0.0] * P, [-1] + list(range(k))
        sc[:k] = cond()
        for d in range(2, S + 1):
            for j in range(k):
                grp = 1 + (d - 2) * k + j
                sc[grp * k:grp * k + k] = [sc[plist[grp]] * c for c in cond()]
            if d < S:
                start = k + (d - 2) * k * k
                lvl = torch.tensor(sc[start:start + k * k])
                plist += (start + torch.sort(lvl, descending=True, stable=True).indices[:k]).tolist()
        scores[b] = torch.tensor(sc)
        plists.append(plist)
    if kind == "invalid":
        pick = torch.rand(bs, P, generator=g)
        scores = torch.where(pick < 0.05, -scores, scores)
        scores = torch.where((pick > 0.05) & (pick < 0.08), float("-inf"), scores)
        scores = torch.where((pick > 0.08) & (pick < 0.1), float("nan"), scores)
    tokens = torch.randint(0, 32000, (bs, P), generator=g)
    return PoolView.from_flat(scores.to(device), tokens.to(device), torch.tensor(plists, device=device), k)


def random_spec(stage, rng, k, S, N):
    """A random request of ``stage`` (its parameters over and under the pool's limits)."""
    if stage == "native":
        return None
    b = rng.randint(1, N + 6)
    if stage == "none":
        return {"policy": "none"}
    if stage == "eagle2":  # a depth below the pool's masks SGLang's ranking (topk 10: at least any pool's k)
        depth = rng.randint(1, S + 1)
        return {"policy": "eagle2", "budget": min(b, 11 + 100 * (depth - 1)), "depth": depth}
    if stage == "talon":
        return {"policy": "talon", "budget": b, "topk": rng.randint(1, k + 2), "mu": rng.choice([0, .01, .05, .2, 1])}
    if stage == "c2t":
        return {"policy": "c2t", "budget": b, "topk": rng.randint(1, k + 2), "beta": rng.choice([0.0, .3, .45, .6, .8]),
                "max_depth": rng.randint(1, S + 1), "classifier": rng.choice([None, OTHER, THIRD])}
    if stage == "chain":
        beta = rng.choice([None, .4, .6])
        return {"policy": "chain", "length": rng.randint(0, S + 2), "beta": beta,
                "classifier": None if beta is None else rng.choice([None, OTHER])}
    return {"policy": "salf", "budget": b, "batch": rng.randint(1, min(b, 64)),
            "th": rng.choice([0.0, .02, .05, .1, .3, .6]), "max_depth": rng.choice([None, rng.randint(1, S)])}


STAGES = ["native", "none", "eagle2", "talon", "c2t", "chain", "salf"]


def torch_conf(pool, params, rows):
    """``[bs, P]`` the confidences ``select_on_pool`` computes (C2T Eq. 6-8), None when the batch has none."""
    ids = rows_module.classifier_ids(params)
    if not ids:
        return None
    bs, P = pool.scores.shape
    feats = c2t_features(pool.val, parent_entropy(pool.val - pool.parent_val, pool.k), pool.level.expand(bs, P))
    return pool_module._Classifiers(ids, rows[:, COLUMNS.index("clf")], pool.scores.device)(feats)


def conf_decisions_clear(pool, params, conf, kconf, ref):
    """No c2t / early-stopping chain decision within float order: every confidence of the row further than
    CONF_TOL from beta, and in c2t rows the confidences C2T ranks (each level's ``passed`` candidates, from the
    tree torch kept: App. A Alg. 1 stage 1 and the first pruning) in the same order in both implementations."""
    for b, p in enumerate(params):
        row = {} if p is None else pool_module._rule_row(p)
        if row.get("beta") is None or row["beta"] < 0:
            continue
        if ((conf[b] - row["beta"]).abs() <= CONF_TOL).any():
            return False
        if p.__class__.__name__ != "C2TParams":
            continue
        kept = torch.zeros(pool.scores.shape[1], dtype=torch.bool, device=conf.device)
        kept[ref[1][b][ref[3][b, 1:]]] = True
        for d, a, e in level_slices(pool.k, pool.scores.shape[1]):
            cand = pool.valid[b, a:e] & (True if d == 1 else kept[pool.parent[b, a:e]])
            order = torch.sort(torch.where(cand, pool.val[b, a:e], float("-inf")), descending=True, stable=True)
            first = torch.zeros_like(cand).scatter(0, order.indices[:p.topk], True)
            passed = cand & first & (conf[b, a:e] >= p.beta) & (p.max_depth >= d)
            c, kc = conf[b, a:e][passed], kconf[b, a:e][passed]
            if not torch.equal((c[:, None] - c[None, :]).sign(), (kc[:, None] - kc[None, :]).sign()):
                return False
    return True


def run_both(pool, N, params, native=None, rows=None, margins=True):
    """The fused selection against ``select_on_pool``: exactly when torch is given the kernel's confidences,
    and exactly against plain torch when ``margins``, where every C2T decision is asserted clear."""
    rows = policy_rows(params, pool.scores.device) if rows is None else rows
    conf = torch_conf(pool, params, rows)
    kconf = conf.clone() if conf is not None else torch.empty(pool.scores.shape, device=pool.scores.device)
    got = _fused()(pool, N, params, native, rows, conf_out=kconf)
    bs = pool.scores.shape[0]
    assert got[0] is pool.parent_list
    assert got[1].dtype == torch.int64 and got[1].shape == (bs, N - 1) and got[1].is_contiguous()
    assert got[2].dtype == pool.tokens.dtype and got[2].shape == (bs, N - 1) and got[3].dtype == torch.bool
    if conf is not None:
        assert torch.allclose(kconf, conf, rtol=0, atol=CONF_TOL, equal_nan=True), (kconf - conf).abs().max()
    with mock.patch.object(pool_module._Classifiers, "__call__", lambda self, feats: kconf):
        same_conf = select_on_pool(pool, N, params, native, rows)
    for name, a, b in zip(("top_scores_index", "draft_tokens", "node_keep"), same_conf[1:], got[1:]):
        assert torch.equal(a, b), (name, (a != b).nonzero()[:4].tolist())
    if margins:
        ref = select_on_pool(pool, N, params, native, rows)
        assert conf is None or conf_decisions_clear(pool, params, conf, kconf, ref), "a C2T decision is not clear"
        for name, a, b in zip(("top_scores_index", "draft_tokens", "node_keep"), ref[1:], got[1:]):
            assert torch.equal(a, b), (name, (a != b).nonzero()[:4].tolist())
    return got


def native_of(pool, N):
    return select_on_pool(pool, N, [None] * pool.scores.shape[0])[:3]




def _fused():
    from treespec_sglang.plugin.pool_kernels import select_on_pool_fused  # triton: the tests skip without it

    return select_on_pool_fused


def compiled_triton() -> bool:
    """Whether this process can compile Triton kernels (not when triton was imported with TRITON_INTERPRET=1)."""
    from triton.language.standard import _sum_combine
    from triton.runtime.jit import JITFunction

    return isinstance(_sum_combine, JITFunction)
