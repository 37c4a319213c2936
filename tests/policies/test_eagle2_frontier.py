"""EAGLE-2's frontier step by step in a batch of mixed ``topk``: each request expands its own k best
candidates (by path log-probability, ties to the lower flat index), never the batch's K."""

import torch

from treespec_sglang.policies import parse_spec
from treespec_sglang.policies.eagle2 import Eagle2Policy


def test_each_request_keeps_its_own_k_best_frontier_nodes():
    specs = [{"policy": "eagle2", "budget": 11, "topk": 4, "depth": 3},
             {"policy": "eagle2", "budget": 6, "topk": 2, "depth": 3},
             {"policy": "eagle2", "budget": 6, "topk": 2, "depth": 2}]  # stops a level early
    pol = Eagle2Policy([parse_spec(s) for s in specs], torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    V = 12
    root_lp = torch.log_softmax(torch.randn(3, V, generator=g), -1)
    frontier = pol.start(torch.tensor([1, 2, 3]), root_lp)
    assert [int((f >= 0).sum()) for f in frontier] == [4, 2, 2]
    child_lp = torch.log_softmax(torch.randn(3, frontier.shape[1], V, generator=g), -1)
    nxt = pol.step(child_lp)
    assert ((nxt >= 0) | (nxt == -1)).all()  # -1 = none, the frontier's contract
    assert nxt[2].tolist() == [-1] * nxt.shape[1]  # request 2 reached its depth 2: nothing to expand
    tree = pol.finish()
    tree.check()
    assert tree.depth_bound == 3 and int(tree.depth[2].max()) == 2
    lp = pol.buf.logprob.tolist()
    for b, k in enumerate([4, 2]):
        # candidates: k children (top-k tokens) of each of the row's k frontier nodes, in flat order
        cands = []
        for j, node in enumerate(frontier[b].tolist()):
            if node < 0:
                continue
            top = sorted(range(V), key=lambda t: -float(child_lp[b, j, t]))[:k]
            cands += [(float(lp[b][node]) + float(child_lp[b, j, t]), j * 4 + c) for c, t in enumerate(top)]
        best = sorted(cands, key=lambda x: (-x[0], x[1]))[:k]
        got = [i for i in nxt[b].tolist() if i >= 0]
        assert len(got) == k
        assert sorted(round(lp[b][i], 5) for i in got) == sorted(round(v, 5) for v, _ in best)


def test_tied_path_values_go_to_the_lower_flat_index():
    """64 candidates with one path value (uniform distributions): the next frontier is the first k in
    SGLang's flat order (frontier node j, child c) -> j * k + c, i.e. node j = 0's k children, in order.
    A deterministic tie rule is what keeps every rank's tree the same. Example, k = 2 and all tied:
    candidates (0, 0) (0, 1) (1, 0) (1, 1) -> frontier (0, 0), (0, 1)."""
    import math

    k, V = 8, 16
    pol = Eagle2Policy([parse_spec({"policy": "eagle2", "budget": 40, "topk": k, "depth": 3})], torch.device("cpu"))
    frontier = pol.start(torch.tensor([1]), torch.full((1, V), -math.log(V)))
    first = frontier[0].tolist()
    assert len(first) == k and min(first) >= 0
    before = int(pol.buf.size[0])
    nxt = pol.step(torch.full((1, k, V), -math.log(V)))[0].tolist()
    # the appended candidates, in flat order (a plain loop over the buffer rows added by this step)
    cands = [i for i in range(before, before + k * k) if int(pol.buf.parents[0, i]) >= 0]
    assert [int(pol.buf.parents[0, i]) for i in cands] == [p for p in first for _ in range(k)]
    assert nxt == cands[:k]
