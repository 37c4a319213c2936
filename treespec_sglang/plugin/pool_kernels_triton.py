"""Triton source of the fused pool selection (:mod:`.pool_kernels` loads it once per mode and launches it).

One program per request row computes what :func:`treespec_sglang.plugin.pool.select_on_pool` computes for
that row, over SGLang's draft pool (topk K, steps S, P = K + (S-1)K^2 candidates, level d >= 2 the block of
K^2 flat indices at ``K + (d-2)K^2``, every run of K flat indices one parent's children):

* SGLang's ranking (stable descending ``scores``, NaN first as ``torch.sort``, ties to the lower flat index),
  the row's ``top`` best kept (native rows, ``none``, EAGLE-2, SALF with th = 0);
* the row's level-wise rule, chosen from its ``kind`` by a kind -> stage table: TALON (App. A Alg. 2),
  C2T (App. A Alg. 1, the classifier of Eq. 6-8 evaluated here from the pool) or the chain (with C2T's early
  stop), one masked step per level as :func:`.pool_rules.level_policies_keep`;
* SALF's best-first search (Alg. 2) as :func:`.pool_rules.salf_keep` on the rows with th > 0, its pops a
  runtime bound (as in the torch path, the ranking and the search apply by the ``top`` and ``th`` columns);
* the custom rows' keep (computed by the host), then the padding to N-1 with SGLang's next best nodes, the
  ascending pool indices, their tokens and the keep mask in verify order.

Every rank is a count of the entries that precede an entry (pairwise compares, no sort), every "k-th member
of a set in an order" a prefix sum in that order: the row is moved into order space (a scatter through the
rank, a permutation) in a per-row scratch area of global memory and back by a gather, with a barrier between
the store and the load. No host value is read: data-dependent bounds (SALF's pops, its B and N) are runtime
ints that do not specialise, pool geometry is ``tl.constexpr``.

Reductions go through ``tl.reduce`` / ``tl.associative_scan`` with Triton's own combine functions, so the same
source runs compiled and in Triton's interpreter when :mod:`.pool_kernels` loads it in that mode after triton
was imported compiled (the interpreter recognises those combine functions, not ``tl.sum`` built compiled).
Without triton this module still imports (the package's doctest walk does): its functions stay plain Python.
"""

try:
    import triton
    import triton.language as tl
    from triton.language.standard import _elementwise_max, _sum_combine

    jit = triton.jit
    IMPORT_ERROR = None
except ImportError as e:  # pool_kernels raises the clear error; importing this module alone stays harmless
    triton = _elementwise_max = _sum_combine = None
    IMPORT_ERROR = f"{type(e).__name__}: {e}"

    class tl:  # noqa: N801  what the annotations and constants below need
        constexpr = int

    def jit(fn=None, **_):
        return fn if fn is not None else (lambda f: f)

from treespec_sglang.plugin.pool import COLUMNS
from treespec_sglang.plugin.pool_kernels import FLAGS, STAGE_CODES

_KIND, _BUDGET, _TOP, _RANK_DEPTH, _TOPK, _LOG_MU, _TH, _BATCH, _MAX_DEPTH, _BETA, _CLF = (
    tl.constexpr(COLUMNS.index(c)) for c in ("kind", "budget", "top", "rank_depth", "topk", "log_mu", "th", "batch",
                                             "max_depth", "beta", "clf"))
_S_TALON, _S_C2T, _S_CHAIN = (tl.constexpr(STAGE_CODES[s]) for s in ("talon", "c2t", "chain"))
_F_TALON, _F_C2T, _F_CHAIN, _F_SALF, _F_CONF, _F_DEPTH, _F_NATIVE, _F_EXTRA = (
    tl.constexpr(FLAGS[f]) for f in ("talon", "c2t", "chain", "salf", "conf", "mask_depth", "native", "extra"))
# the per-row int32 scratch regions (each BLOCK_P wide) and the float32 ones
_R_RANK, _R_PACK, _R_LEVEL, _R_D0, _R_D1, _R_SALF, _R_KEEP, _R_FILL = (tl.constexpr(i) for i in range(8))
N_WORK = 8
N_WORKF = 2


@jit
def _sum(x, axis: tl.constexpr):
    """``x`` summed over ``axis`` (int32 or float32 in, the same type out)."""
    return tl.reduce(x, axis, _sum_combine)


@jit
def _max(x):
    """``[W]`` -> scalar maximum (never given NaN here)."""
    return tl.reduce(x, 0, _elementwise_max)


@jit
def _cumsum(x):
    """``[W]`` int32 inclusive prefix sum."""
    return tl.associative_scan(x, 0, _sum_combine)


@jit
def _spread(c, like):
    """Scalar bool ``c`` as a bool block shaped like the int32 block ``like``. Every scalar condition meets a
    block through this: Triton's interpreter splats a comparison's scalar result with its operands' dtype."""
    return (like * 0 + c.to(tl.int32)) != 0


@jit
def _before(xj, xi, j, i):
    """Entry j precedes entry i in ``torch.sort(descending=True, stable=True)``: larger first, NaN before
    everything, equal values (NaN with NaN, -0.0 with 0.0) in index order. Broadcasting bool."""
    nj = xj != xj
    ni = xi != xi
    return (xj > xi) | (nj & ~ni) | (((xj == xi) | (nj & ni)) & (j < i))


@jit
def _rank(x, lane, width):
    """``[W]`` float32 -> ``[W]`` int32, each lane's place in the stable descending sort of lanes < width
    (:func:`.pool_rules._rank`). Example: [.5, .9, .5] -> [1, 0, 2]."""
    ahead = _before(x[None, :], x[:, None], lane[None, :], lane[:, None]) & (lane[None, :] < width)
    return _sum(ahead.to(tl.int32), 1)


@jit
def _level_of(f, K: tl.constexpr):
    """Pool level of flat indices ``f`` (root's children 1): K 2 -> [1, 1, 2, 2, 2, 2, 3, ...]."""
    return tl.where(f < K, 1, 2 + tl.maximum(f - K, 0) // (K * K))


@jit
def _ordinal(x):
    """:func:`.pool_rules.flat_order_key`'s int32 ordinal of float32 ``x``: the bits, a negative value's
    magnitude bits flipped, so int order is float order."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@jit
def _rank_row(src, key, offs, rank_depth, mask_depth, BY_BITS: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
              CHUNK: tl.constexpr):
    """``[BLOCK_P]`` int32 place of each pool node in a row-wide order, padding lanes (>= P) after it.

    ``src`` the row's ``[P]`` values in memory, ``key`` ``[BLOCK_P]`` the same keys in registers, ``offs``
    ``[BLOCK_P]`` int32 lanes. ``BY_BITS``: descending ``flat_order_key(val)`` (SALF's order; ``src`` the row's
    val, ``key`` its ordinals); else SGLang's ranking of ``scores`` (``src``), the levels below ``rank_depth``
    sent to -inf when ``mask_depth`` (scalar; ``key`` the masked scores). Counted CHUNK columns at a time.
    """
    rank = offs * 0
    for j0 in range(0, P, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        jm = j < P
        if BY_BITS:
            kj = _ordinal(tl.load(src + j, mask=jm, other=float("-inf")))
            ahead = (kj[None, :] > key[:, None]) | ((kj[None, :] == key[:, None]) & (j[None, :] < offs[:, None]))
        else:
            sj = tl.load(src + j, mask=jm, other=0.0)
            sj = tl.where(_spread(mask_depth, j) & ~(_level_of(j, K).to(tl.float32) <= rank_depth), float("-inf"),
                          sj)
            ahead = _before(sj[None, :], key[:, None], j[None, :], offs[:, None])
        rank += _sum((ahead & jm[None, :]).to(tl.int32), 1)
    return tl.where(offs < P, rank, offs)


@jit
def _confidence(val_row, parent_row, f, fm, depth, w_row, K: tl.constexpr, BLOCK_K: tl.constexpr,
                HB: tl.constexpr):
    """``[W]`` C2T confidence of the pool nodes ``f`` (``[W]`` int32 flat indices, ``fm`` ``[W]`` bool lanes in
    use; C2T Eq. 6-8): the row's classifier (``w_row``: its ``[6, HB]`` slice of the stacked table: fc1's three
    weight columns, fc1's bias, fc2's weights, fc2's bias) on (path probability ``exp(val)``, the parent's
    K-slot entropy as :func:`.pool_rules.parent_entropy`, ``depth``), from the row's ``[P]`` val
    (``val_row``) and parents (``parent_row``). float32 in an evaluation order of its own (:mod:`.pool_kernels`)."""
    v = tl.load(val_row + f, mask=fm, other=float("-inf"))
    par = tl.load(parent_row + f, mask=fm, other=-1).to(tl.int32)
    pv = tl.where(par < 0, 0.0, tl.load(val_row + tl.maximum(par, 0), mask=fm, other=0.0))
    t = tl.arange(0, BLOCK_K)
    sib = tl.load(val_row + ((f // K) * K)[:, None] + t[None, :], mask=fm[:, None] & (t[None, :] < K),
                  other=float("-inf"))  # [W, BLOCK_K] the K siblings' path values
    lp = sib - pv[:, None]  # their conditional log-probabilities
    p = tl.exp(lp)
    ent = -_sum(tl.where(p > 0, p * tl.where(p > 0, lp, 0.0), 0.0), 1)  # no 0 * -inf computed
    h = tl.arange(0, HB)
    hid = (tl.exp(v)[:, None] * tl.load(w_row + h)[None, :] + ent[:, None] * tl.load(w_row + HB + h)[None, :]
           + depth * tl.load(w_row + 2 * HB + h)[None, :] + tl.load(w_row + 3 * HB + h)[None, :])
    z = _sum(tl.maximum(hid, 0.0) * tl.load(w_row + 4 * HB + h)[None, :], 1) + tl.load(w_row + 5 * HB)
    return 1.0 / (1.0 + tl.exp(-z))


@jit
def _salf_keep(val_row, parent_row, work_row, workf_row, v, valid, lev, n1, th, batch, max_depth, pops, b_max, kth,
               offs, K: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr):
    """``[BLOCK_P]`` bool, SALF's tree for this row (Alg. 2, :func:`.pool_rules.salf_keep`), as prefix sums in
    the order of ``flat_order_key(val)``.

    ``val_row`` / ``parent_row`` the row's ``[P]`` val and parents, ``work_row`` / ``workf_row`` its ``[8 * BLOCK_P]``
    int32 / ``[2 * BLOCK_P]`` float32 scratch; ``v`` / ``valid`` / ``lev`` / ``offs`` ``[BLOCK_P]`` the row's val,
    validity, levels and lanes; ``n1`` = n_eff - 1 and the row's th / batch / max_depth columns (scalars);
    ``pops``, ``b_max``, ``kth`` bounds valid for the batch (:func:`.pool_rules.salf_keep`'s, or the
    batch-independent ones of a captured launch, :func:`.pool_kernels.graph_args`: the same tree; the pops
    loop leaves once the row has stopped, so a loose bound costs nothing). Q and G live in
    order space: the B best of Q are Q's members with prefix count <= B (lines 5-9), eps the value of G's
    member of prefix count eps_at + 1 (lines 10-11), D's children join Q through the parent's order position
    (lines 12-20), and the output is G's first n1 members.
    """
    md = max_depth.to(tl.int32)
    live = (md >= 1) & (n1 >= 1)  # scalar
    inp = offs < P
    rank_v = _rank_row(val_row, _ordinal(v), offs, 0.0, False, True, K, P, CHUNK)
    par = tl.load(parent_row + offs, mask=inp, other=0).to(tl.int32)
    tl.store(work_row + _R_RANK * BLOCK_P + offs, rank_v)
    tl.debug_barrier()
    ppos = tl.load(work_row + _R_RANK * BLOCK_P + tl.minimum(tl.maximum(par, 0), P - 1), mask=inp, other=0)
    child_ok = valid & (lev <= md) & (lev > 1)  # may enter Q under an expanded node (line 12)
    q0 = valid & (lev == 1)
    tl.store(work_row + _R_PACK * BLOCK_P + rank_v, ppos * 4 + child_ok.to(tl.int32) * 2 + q0.to(tl.int32))
    tl.store(workf_row + rank_v, v)
    tl.store(workf_row + BLOCK_P + rank_v, tl.exp(v))  # every member of D is a gain (max_depth's: childless)
    tl.debug_barrier()
    packed = tl.load(work_row + _R_PACK * BLOCK_P + offs)  # order space from here on
    val_s = tl.load(workf_row + offs)
    gain_s = tl.load(workf_row + BLOCK_P + offs)
    ppos_s = packed >> 2
    child_s = (packed & 2) != 0
    q = ((packed & 1) != 0) & _spread(live, offs)
    g = q & False
    b_row = tl.minimum(batch.to(tl.int32), b_max)
    eps_at = tl.minimum(tl.maximum(n1 - 1, 0), kth - 1)
    it = 0
    while (it < pops) & live:  # a stopped row is frozen (Q empty): leaving early changes nothing
        pop = q & (_cumsum(q.to(tl.int32)) <= b_row)
        g = g | pop
        eps = _max(tl.where(g & (_cumsum(g.to(tl.int32)) == eps_at + 1), val_s, float("-inf")))
        D = pop & (val_s > eps)
        live = live & (_sum(D.to(tl.float32) * gain_s, 0) >= th)  # line 13
        region = work_row + (_R_D0 + it % 2) * BLOCK_P  # two buffers: one barrier per pop
        tl.store(region + offs, D.to(tl.int32))
        tl.debug_barrier()
        q = ((q & ~pop) | ((tl.load(region + ppos_s) != 0) & child_s)) & _spread(live, offs)
        it += 1
    sel = g & (_cumsum(g.to(tl.int32)) <= n1)
    tl.store(work_row + _R_SALF * BLOCK_P + offs, sel.to(tl.int32))
    tl.debug_barrier()
    return (tl.load(work_row + _R_SALF * BLOCK_P + rank_v) != 0) & inp


@jit(do_not_specialize=["n_kinds", "n_clf", "flags", "pops", "b_max", "kth"])
def pool_select_kernel(scores_ptr, val_ptr, parent_ptr, tokens_ptr, rows_ptr, stage_ptr, clf_ids_ptr, clf_w_ptr,
                       native_ptr, extra_ptr, top_ptr, tok_ptr, keep_ptr, conf_ptr, work_ptr, workf_ptr,
                       n_kinds, n_clf, flags, pops, b_max, kth,
                       F: tl.constexpr, K: tl.constexpr, S: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       HB: tl.constexpr, CHUNK: tl.constexpr, WRITE_CONF: tl.constexpr):
    """One request row's selection (grid: ``(bs,)``); see the module docstring.

    Inputs: ``scores_ptr`` ``[bs, P]`` float32 (``pool.scores``), ``val_ptr`` ``[bs, P]`` float32 (``pool.val``),
    ``parent_ptr`` ``[bs, P]`` int64 (``pool.parent``), ``tokens_ptr`` ``[bs, P]`` (``pool.tokens``),
    ``rows_ptr`` ``[bs, F]`` float32 (the row table), ``stage_ptr`` ``[n_kinds]`` int32 (kind -> stage code),
    ``clf_ids_ptr`` ``[n_clf]`` float32 (the batch's classifier ids, ascending), ``clf_w_ptr`` ``[n_clf, 6, HB]``
    float32 (their weights), ``native_ptr`` ``[bs, N-1]`` int64 (SGLang's selection; read when
    ``flags & native``), ``extra_ptr`` ``[bs, P]`` bool (OR'ed into the keep when ``flags & extra``).
    Outputs: ``top_ptr`` ``[bs, N-1]`` int64, ``tok_ptr`` ``[bs, N-1]`` (tokens' dtype), ``keep_ptr`` ``[bs, N]``
    bool, ``conf_ptr`` ``[bs, P]`` float32 (the level rows' confidences, only when ``WRITE_CONF``).
    Scratch: ``work_ptr`` ``[bs, 8 * BLOCK_P]`` int32, ``workf_ptr`` ``[bs, 2 * BLOCK_P]`` float32.
    Runtime ints: ``flags`` (:data:`.pool_kernels.FLAGS`), SALF's ``pops`` / ``b_max`` / ``kth`` (as
    :func:`.pool_rules.salf_keep` derives them).
    """
    b = tl.program_id(0).to(tl.int64)
    scores_row = scores_ptr + b * P
    val_row = val_ptr + b * P
    parent_row = parent_ptr + b * P
    tokens_row = tokens_ptr + b * P
    work_row = work_ptr + b * (8 * BLOCK_P)
    top_row = top_ptr + b * (N - 1)
    tok_row = tok_ptr + b * (N - 1)
    keep_row = keep_ptr + b * N
    row = rows_ptr + b * F
    kind = tl.load(row + _KIND)
    lane_n = tl.arange(0, BLOCK_N)
    if ((flags & _F_NATIVE) != 0) & (kind == 0.0):  # no policy and SGLang's selection given: taken verbatim
        idx = tl.load(native_ptr + b * (N - 1) + lane_n, mask=lane_n < N - 1, other=0)
        tl.store(top_row + lane_n, idx, mask=lane_n < N - 1)
        tl.store(tok_row + lane_n, tl.load(tokens_row + idx, mask=lane_n < N - 1), mask=lane_n < N - 1)
        tl.store(keep_row + lane_n, lane_n >= 0, mask=lane_n < N)
    else:
        stage = tl.load(stage_ptr + tl.minimum(tl.maximum(kind.to(tl.int32), 0), n_kinds - 1))
        n_eff = tl.minimum(tl.load(row + _BUDGET), N).to(tl.int32)  # tree size cap, root included
        limit = tl.minimum(tl.load(row + _TOP), N - 1).to(tl.int32)
        rank_depth = tl.load(row + _RANK_DEPTH)
        offs = tl.arange(0, BLOCK_P)
        inp = offs < P
        s = tl.load(scores_row + offs, mask=inp, other=0.0)
        v = tl.load(val_row + offs, mask=inp, other=float("-inf"))
        lev = _level_of(offs, K)
        valid = (s > 0) & inp
        # SGLang's ranking, the row's `top` best kept (levels below rank_depth masked when the batch asks)
        mask_depth = (flags & _F_DEPTH) != 0
        deep = _spread(mask_depth, offs) & ~(lev.to(tl.float32) <= rank_depth)  # masked out of the ranking
        rank_s = _rank_row(scores_row, tl.where(deep, float("-inf"), s), offs, rank_depth, mask_depth, False, K, P,
                           CHUNK)
        keep = (rank_s < limit) & inp & ~deep
        level_on = (((stage == _S_TALON) & ((flags & _F_TALON) != 0)) | ((stage == _S_C2T) & ((flags & _F_C2T) != 0))
                    | ((stage == _S_CHAIN) & ((flags & _F_CHAIN) != 0)))
        if level_on:  # TALON / C2T / chain: one masked step per level
            has_conf = ((flags & _F_CONF) != 0) & (stage != _S_TALON)  # scalar
            clf = tl.load(row + _CLF)
            slot = n_eff * 0
            for j in range(1, n_clf):  # the batch's first classifier unless the row names another
                slot = tl.where(tl.load(clf_ids_ptr + j) == clf, j, slot)
            w_row = clf_w_ptr + slot * (6 * HB)
            topk = tl.load(row + _TOPK).to(tl.int32)
            log_mu = tl.load(row + _LOG_MU)
            beta = tl.load(row + _BETA)
            max_depth = tl.load(row + _MAX_DEPTH)
            lane = tl.arange(0, BLOCK_W)
            scored = _spread(has_conf, lane)
            size = n_eff * 0 + 1
            for d in range(1, S + 1):
                start = tl.where(d == 1, 0, K + (d - 2) * K * K)
                width = tl.where(d == 1, K, K * K)
                f = start + lane
                fm = lane < width
                vl = tl.load(val_row + f, mask=fm, other=float("-inf"))
                par = tl.load(parent_row + f, mask=fm & (d > 1), other=0).to(tl.int32)
                par_kept = tl.load(work_row + _R_LEVEL * BLOCK_P + tl.minimum(tl.maximum(par, 0), P - 1),
                                   mask=fm & (d > 1), other=1)
                cand = (tl.load(scores_row + f, mask=fm, other=0.0) > 0) & fm & (par_kept != 0)
                remaining = n_eff - size
                vc = tl.where(cand, vl, float("-inf"))
                r_cand = _rank(vc, lane, width)
                conf = tl.full([BLOCK_W], 0.0, tl.float32)
                if has_conf:
                    conf = _confidence(val_row, parent_row, f, fm, d * 1.0, w_row, K, BLOCK_K, HB)
                new = cand & False
                if stage == _S_TALON:  # level 1: the root's top min(K, remaining); then mu * max_d gate, budget
                    gate = (vl >= _max(vc) + log_mu) & cand
                    r_gate = _rank(tl.where(gate, vl, float("-inf")), lane, width)
                    new = tl.where(d == 1, cand & (r_cand < tl.minimum(topk, remaining)), gate & (r_gate < remaining))
                if stage == _S_C2T:  # top-K by path value, C_i >= beta, top min(K, remaining) by confidence
                    passed = (r_cand < topk) & (conf >= beta) & _spread(max_depth >= d, lane) & cand
                    r_conf = _rank(tl.where(passed, conf, float("-inf")), lane, width)
                    new = passed & (r_conf < tl.minimum(remaining, topk))
                if stage == _S_CHAIN:  # the best child while the budget lasts (and C_i >= beta with a stop)
                    new = (r_cand == 0) & _spread(remaining > 0, lane) & cand & ((conf >= beta) | ~scored)
                tl.store(work_row + _R_LEVEL * BLOCK_P + f, new.to(tl.int32), mask=fm)
                if WRITE_CONF:
                    tl.store(conf_ptr + b * P + f, conf, mask=fm & scored)
                size += _sum(new.to(tl.int32), 0)
                tl.debug_barrier()
            keep = keep | ((tl.load(work_row + _R_LEVEL * BLOCK_P + offs, mask=inp, other=0) != 0) & inp)
        th = tl.load(row + _TH)
        if ((flags & _F_SALF) != 0) & (th > 0):  # SALF's search (th = 0 rows took their top-N from the ranking)
            keep = keep | _salf_keep(val_row, parent_row, work_row, workf_ptr + b * (2 * BLOCK_P), v, valid, lev,
                                     n_eff - 1, th, tl.load(row + _BATCH), tl.load(row + _MAX_DEPTH), pops, b_max,
                                     kth, offs, K, P, BLOCK_P, CHUNK)
        if (flags & _F_EXTRA) != 0:  # the custom rows' own keep
            keep = keep | ((tl.load(extra_ptr + b * P + offs, mask=inp, other=0) != 0) & inp)
        # pad to N-1 with the best unselected nodes in SGLang's ranking (a prefix sum in its order)
        need = (N - 1) - _sum(keep.to(tl.int32), 0)
        tl.store(work_row + _R_KEEP * BLOCK_P + rank_s, keep.to(tl.int32))
        tl.debug_barrier()
        unsel = (tl.load(work_row + _R_KEEP * BLOCK_P + offs) == 0) & inp
        fill = unsel & (_cumsum(unsel.to(tl.int32)) <= need)
        tl.store(work_row + _R_FILL * BLOCK_P + offs, fill.to(tl.int32))
        tl.debug_barrier()
        chosen = (keep | (tl.load(work_row + _R_FILL * BLOCK_P + rank_s) != 0)) & inp
        pos = _cumsum(chosen.to(tl.int32)) - 1  # verify place: ascending pool index
        out = chosen & (pos < N - 1)
        tl.store(top_row + pos, offs.to(tl.int64), mask=out)
        tl.store(tok_row + pos, tl.load(tokens_row + offs, mask=inp), mask=out)
        tl.store(keep_row + 1 + pos, keep, mask=out)
        tl.store(keep_row + lane_n, lane_n >= 0, mask=lane_n == 0)  # the root


@jit
def unlink_kernel(next_token_ptr, next_sibling_ptr, keep_ptr, work_ptr, N, BLOCK_N: tl.constexpr,
                  ROUNDS: tl.constexpr):
    """:func:`treespec_sglang.plugin.pool.unlink_filler` in place for row ``program_id``: ``next_token`` /
    ``next_sibling`` ``[bs, N]`` int64 and ``keep`` ``[bs, N]`` bool, contiguous; ``work`` ``[bs, BLOCK_N]`` int64
    scratch. J[x], the first kept node on x's sibling chain from x, by ``ROUNDS`` rounds of pointer jumping
    through the scratch row (a barrier between every store and the loads that follow), then each kept node's
    first child and next sibling skip to their J, every filler's links become -1."""
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    m = offs < N
    keep = (tl.load(keep_ptr + b * N + offs, mask=m, other=0) != 0) & m
    nt = tl.load(next_token_ptr + b * N + offs, mask=m, other=-1)
    ns = tl.load(next_sibling_ptr + b * N + offs, mask=m, other=-1)
    work = work_ptr + b * BLOCK_N
    jump = tl.where(keep, offs.to(tl.int64), ns)
    for _ in tl.static_range(ROUNDS):
        tl.store(work + offs, jump, mask=m)
        tl.debug_barrier()
        nxt = tl.load(work + tl.maximum(jump, 0), mask=m & (jump >= 0), other=-1)
        tl.debug_barrier()
        jump = tl.where(jump >= 0, nxt, jump)
    tl.store(work + offs, jump, mask=m)
    tl.debug_barrier()
    child = tl.load(work + tl.maximum(nt, 0), mask=m & (nt >= 0), other=-1)
    sibling = tl.load(work + tl.maximum(ns, 0), mask=m & (ns >= 0), other=-1)
    tl.store(next_token_ptr + b * N + offs, tl.where(keep, child, -1), mask=m)
    tl.store(next_sibling_ptr + b * N + offs, tl.where(keep, sibling, -1), mask=m)
