"""Run SGLang 0.5.23's own Triton reference kernels under ``TRITON_INTERPRET=1`` (on the CPU) next to our
torch stand-ins, on random cases; print one JSON line ``{op: [[seed, mismatching case], ...]}``.

Executed in a subprocess by ``test_kernels.py`` (the interpreter must be chosen before triton loads,
and SGLANG_USE_CPU_ENGINE must be unset so SGLang's modules import their Triton kernels).
"""

import json
import os
import random
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.pop("SGLANG_USE_CPU_ENGINE", None)

import torch  # noqa: E402
from sglang.kernels.ops.speculative import cache_locs, eagle, spec_tree  # noqa: E402
from sglang.kernels.ops.speculative.gather_spec_extras import gather_spec_extras  # noqa: E402
from sglang.srt.mem_cache import allocation  # noqa: E402
from sglang.srt.utils import next_power_of_2  # noqa: E402

from treespec_sglang.plugin.cpu import kernels as ours  # noqa: E402
from treespec_sglang.plugin.cpu import overlap  # noqa: E402


def beam_selection(rng, bs, topk, steps, N, connected=True):
    """A random EAGLE beam selection: parent_list + sorted top_scores_index (``connected=False`` may
    select a node without its parent, which the kernel hangs off the root unlinked)."""
    n_slots = topk + (steps - 1) * topk * topk  # flat score slots: k, then k*k per later step
    parent_lists, selections = [], []
    for _ in range(bs):
        # select_top_k_tokens' parents: step 0 -> [-1, 0..k-1], step i >= 1 -> the flat score indices of
        # the k frontier nodes expanded at step i + 1 (parent_list drops the last step's entry)
        plist = [-1] + list(range(topk))
        for i in range(1, steps - 1):
            base = topk + (i - 1) * topk * topk
            plist += rng.sample(range(base, base + topk * topk), topk)
        # choose N-1 slots that form a connected tree: include a slot only if its parent slot is chosen
        chosen = set()
        order = list(range(n_slots))
        rng.shuffle(order)
        while len(chosen) < N - 1:
            for s in order:
                if s in chosen or len(chosen) >= N - 1:
                    continue
                if s < topk:
                    chosen.add(s)
                    continue
                par = plist[s // topk]  # the flat index of the node slot s was expanded from
                if par in chosen or not connected:
                    chosen.add(s)
        parent_lists.append(plist)
        selections.append(sorted(chosen))
    return torch.tensor(parent_lists), torch.tensor(selections)


def check_build_tree(rng, mode):
    bad = []
    for case in range(6):
        bs, topk, steps = rng.randint(1, 3), rng.randint(2, 3), rng.randint(2, 4)
        N = rng.randint(2, min(8, topk + (steps - 1) * topk * topk) + 1)
        parent_list, sel = beam_selection(rng, bs, topk, steps, N, connected=case % 3 != 2)
        seq = torch.randint(1, 9, (bs,))
        outs = []
        for fn in ("triton", "ours"):
            if mode == 0:
                mask = torch.ones(int(seq.sum()) * N + N * N * bs, dtype=torch.bool)
            else:
                mask = torch.ones(N * N * bs, dtype=torch.bool)
            pos = torch.zeros(bs * N, dtype=torch.long)
            rbuf = torch.full((3, bs, N), -1, dtype=torch.long)
            if fn == "triton":
                prefix = torch.cumsum(seq, 0) - seq
                spec_tree.sgl_build_tree_kernel_efficient_triton[(bs,)](
                    parent_list, sel, seq, prefix, mask, pos, rbuf[0], rbuf[1], rbuf[2], topk, steps, N, mode, bs,
                    parent_list.shape[1], sel.shape[1])
            else:
                ours.build_tree_kernel_efficient_cpu(parent_list, sel, seq, mask, pos, rbuf[0], rbuf[1], rbuf[2],
                                                     topk, steps, N, mode)
            outs.append((mask, pos, rbuf))
        if not all(torch.equal(a, b) for a, b in zip(outs[0], outs[1])):
            bad.append(case)
    return bad


def check_verify_greedy(rng):
    bad = []
    for case in range(8):
        bs, topk, steps = rng.randint(1, 3), rng.randint(2, 3), rng.randint(2, 4)
        N = rng.randint(2, min(8, topk + (steps - 1) * topk * topk) + 1)
        parent_list, sel = beam_selection(rng, bs, topk, steps, N)
        seq = torch.full((bs,), 5)
        rbuf = torch.full((3, bs, N), -1, dtype=torch.long)
        ours.build_tree_kernel_efficient_cpu(parent_list, sel, seq, torch.ones(N * N * bs, dtype=torch.bool),
                                             torch.zeros(bs * N, dtype=torch.long), rbuf[0], rbuf[1], rbuf[2],
                                             topk, steps, N, 1)
        if case % 2:  # the kernels read the target's token at node u at target_predict.flat[retrive_index[b, u]]
            rbuf[0] = torch.tensor(rng.sample(range(bs * N), bs * N)).view(bs, N)
        V = 3  # tiny vocab: many matches, repeated sibling tokens
        cand = torch.randint(0, V, (bs, N))
        target = torch.randint(0, V, (bs, N))
        outs = []
        for fn in ("triton", "ours"):
            # SGLang's dtypes (eagle_utils.eagle_sample): int32 outputs, int64 tree tensors
            predicts = torch.full((bs * N,), -7, dtype=torch.int32)
            accept_index = torch.full((bs, steps + 1), -1, dtype=torch.int32)
            num = torch.full((bs,), -3, dtype=torch.int32)
            if fn == "triton":
                spec_tree.verify_tree_greedy_triton(predicts, accept_index, num, cand, rbuf[0], rbuf[1], rbuf[2],
                                                    target)
            else:
                ours.verify_tree_greedy_cpu(predicts, accept_index, num, cand, rbuf[0], rbuf[1], rbuf[2], target)
            outs.append((predicts, accept_index, num))
        if not all(torch.equal(a, b) for a, b in zip(outs[0], outs[1])):
            bad.append(case)
    return bad


def segments(rng, bs, pool_rows, pool_len):
    rpi = torch.tensor(rng.sample(range(pool_rows), bs))
    start = torch.tensor([rng.randint(0, 10) for _ in range(bs)])
    end = start + torch.tensor([rng.randint(0, 40) for _ in range(bs)])
    return rpi, start, end


def check_cache_locs(rng):
    bad = {"assign_req_to_token_pool_cpu": [], "assign_extend_cache_locs_cpu": [],
           "assign_draft_cache_locs_contiguous_cpu": []}
    for case in range(5):
        bs, rows, L = rng.randint(1, 5), 6, 64
        rpi, start, end = segments(rng, bs, rows, L)
        total = int((end - start).sum())
        loc = torch.randint(0, 1000, (total,))  # SGLang's dtypes: int64 slots, an int32 req_to_token,
        base = torch.randint(0, 1000, (rows, L), dtype=torch.int32)  # int32 offsets (cur / nxt kv lens)
        start, end = start.int(), end.int()
        a, b = base.clone(), base.clone()
        allocation.assign_req_to_token_pool[(bs,)](rpi, a, start, end, loc, L, next_power_of_2(bs))
        ours.assign_req_to_token_pool_cpu(rpi, b, start, end, loc, L)
        if not torch.equal(a, b):
            bad["assign_req_to_token_pool_cpu"].append(case)
        o1, o2 = torch.full((total,), -1), torch.full((total,), -1)
        cache_locs.assign_extend_cache_locs[(bs,)](rpi, base, start, end, o1, L, next_power_of_2(bs))
        ours.assign_extend_cache_locs_cpu(rpi, base, start, end, o2, L)
        if not torch.equal(o1, o2):
            bad["assign_extend_cache_locs_cpu"].append(case)
        topk, steps = rng.randint(1, 4), rng.randint(1, 4)
        seq = torch.randint(0, L - topk * steps, (bs,))
        d1, d2 = torch.full((bs * topk * steps,), -1), torch.full((bs * topk * steps,), -1)
        cache_locs.assign_draft_cache_locs_contiguous[(bs,)](rpi, base, seq, d1, L, topk, steps, BS=bs)
        ours.assign_draft_cache_locs_contiguous_cpu(rpi, base, seq, d2, L, topk, steps)
        if not torch.equal(d1, d2):
            bad["assign_draft_cache_locs_contiguous_cpu"].append(case)
    return bad


def check_eagle_fills(rng):
    bad = {"fill_bonus_tokens_cpu": [], "fill_accept_out_cache_loc_cpu": []}
    for case in range(5):
        bs, width = rng.randint(1, 5), rng.randint(2, 5)
        tokens = torch.randint(0, 100, (bs, width), dtype=torch.int32)  # SGLang's int32 predict / lens
        lens = torch.randint(1, width + 1, (bs,), dtype=torch.int32)
        b1, b2 = torch.full((bs,), -1, dtype=torch.int32), torch.full((bs,), -1, dtype=torch.int32)
        eagle.fill_bonus_tokens[(bs,)](tokens, lens, b1, width)
        ours.fill_bonus_tokens_cpu(tokens, lens, b2, width)
        if not torch.equal(b1, b2):
            bad["fill_bonus_tokens_cpu"].append(case)
        idx = torch.arange(bs * width).view(bs, width)
        idx = torch.where(torch.arange(width)[None, :] < lens[:, None], idx, -1).int()  # SGLang's int32 accept_index
        loc = torch.randint(0, 1000, (bs * width,))
        o1, o2 = torch.full((bs * width,), -1), torch.full((bs * width,), -1)  # SGLang's size: bs * steps
        eagle.fill_accept_out_cache_loc[(bs * width,)](idx, loc, o1, next_power_of_2(bs * width))
        ours.fill_accept_out_cache_loc_cpu(idx, loc, o2)
        if not torch.equal(o1, o2):
            bad["fill_accept_out_cache_loc_cpu"].append(case)
    return bad


def check_gather_spec_extras(rng):
    """The overlap future map's gather: random row counts and widths (past one column block of 1024 too), repeated
    and unsorted indices of either integer type, a strided index tensor, with and without hidden states."""
    bad = []
    for case in range(6):
        rows, m, k = rng.randint(1, 9), rng.randint(0, 7), rng.randint(1, 5)
        hidden = rng.choice([None, 8, 1100]) if case else 1100
        bufs = (torch.rand(rows, k), torch.randint(0, 500, (rows, k)), torch.randint(0, 500, (rows,)),
                None if hidden is None else torch.randn(rows, hidden))
        idx = torch.tensor([rng.randrange(rows) for _ in range(2 * m)], dtype=rng.choice([torch.int32, torch.int64]))
        idx = idx[::2] if case % 2 else idx[:m]  # a strided view: SGLang's wrapper makes it contiguous
        want, got = gather_spec_extras(idx, *bufs), overlap.gather_spec_extras(idx, *bufs)
        if any((a is None) != (b is None) or (a is not None and (a.dtype != b.dtype or not torch.equal(a, b)))
               for a, b in zip(want, got)):
            bad.append(case)
    return bad


def check_seed(seed: int) -> dict:
    """``{op: [mismatching case]}`` for one seed's random cases."""
    rng = random.Random(seed)
    torch.manual_seed(rng.randint(0, 10 ** 6))
    result = {"build_tree_kernel_efficient_cpu[FULL_MASK]": check_build_tree(rng, 0),
              "build_tree_kernel_efficient_cpu[QLEN_ONLY]": check_build_tree(rng, 1),
              "verify_tree_greedy_cpu": check_verify_greedy(rng), "gather_spec_extras": check_gather_spec_extras(rng)}
    result.update(check_cache_locs(rng))
    result.update(check_eagle_fills(rng))
    return result


def main():
    """Every seed named on the command line (default 0) in this one process (SGLang and triton load once):
    ``{op: [[seed, case], ...]}``."""
    out = {}
    for seed in [int(a) for a in sys.argv[1:]] or [0]:
        for op, bad in check_seed(seed).items():
            out.setdefault(op, []).extend([seed, c] for c in bad)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
