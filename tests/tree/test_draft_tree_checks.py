"""DraftTree's validation (constructor and ``check``: every rule, each bad input raising an error that names
its field), ``from_lists``, ``TreeBuffer``'s empty state, ``stack_rows`` and ``compact`` against plain
Python loops over the per-request lists."""

import random

import pytest
import torch

from tests.helpers import random_tree_lists
from treespec_sglang.tree import DraftTree, TreeBuffer, compact, stack_rows

NEG = float("-inf")


def fields(t: DraftTree) -> dict:
    return dict(tokens=t.tokens.clone(), parents=t.parents.clone(), depth=t.depth.clone(), logprob=t.logprob.clone(),
                size=t.size.clone())


def good_tree():
    """Two requests, 4 and 2 nodes (request 1 padded): [9 -> 7 -> 8, 9 -> 5] and [3 -> 4]."""
    return DraftTree.from_lists([[9, 7, 5, 8], [3, 4]], [[-1, 0, 0, 1], [-1, 0]],
                                [[0.0, -0.5, -1.0, -0.7], [0.0, -0.1]])


# ------------------------------------------------------------------ constructor
@pytest.mark.parametrize("field, bad, msg", [
    ("tokens", lambda f: f["tokens"][0], r"tokens must be \[bs, n_nodes\], got shape \(4,\)"),
    ("parents", lambda f: f["parents"].int(), r"parents must be int64 \(2, 4\), got torch.int32"),
    ("parents", lambda f: f["parents"][:, :3], r"parents must be int64 \(2, 4\), got torch.int64 \(2, 3\)"),
    ("depth", lambda f: f["depth"].float(), r"depth must be int64 \(2, 4\), got torch.float32"),
    ("tokens", lambda f: f["tokens"].int(), r"tokens must be int64 \(2, 4\), got torch.int32"),
    ("logprob", lambda f: f["logprob"].double(), r"logprob must be float32 \(2, 4\), got torch.float64"),
    ("logprob", lambda f: f["logprob"][:1], r"logprob must be float32 \(2, 4\), got torch.float32 \(1, 4\)"),
    ("size", lambda f: f["size"].int(), r"size must be int64 \[2\], got torch.int32"),
    ("size", lambda f: f["size"][:, None], r"size must be int64 \[2\], got torch.int64 \(2, 1\)"),
])
def test_constructor_names_the_bad_field(field, bad, msg):
    f = fields(good_tree())
    f[field] = bad(f)
    with pytest.raises(ValueError, match=msg):
        DraftTree(**f)


def test_constructor_rejects_no_root_and_a_negative_depth_bound():
    with pytest.raises(ValueError, match=r"^n_nodes must be >= 1 \(the root\)$"):
        DraftTree(*(torch.zeros(2, 0, dtype=torch.int64) for _ in range(3)), torch.zeros(2, 0), torch.ones(2).long())
    with pytest.raises(ValueError, match=r"depth_bound must be >= 0, got -1"):
        DraftTree(**fields(good_tree()), depth_bound=-1)
    assert DraftTree(**fields(good_tree()), depth_bound=0).depth_bound == 0  # 0 is allowed
    assert DraftTree(**fields(good_tree())).depth_bound == 3  # default: n_nodes - 1


# ------------------------------------------------------------------ check
def broken(edit):
    f = fields(good_tree())
    edit(f)
    return f


def put(name, b, i, v):
    def edit(f):
        if i is None:
            f[name][b] = v
        else:
            f[name][b, i] = v
    return edit


@pytest.mark.parametrize("edit, msg", [
    (put("size", 1, None, 0), r"size must be in \[1, 4\], got \[4, 0\]"),
    (put("size", 0, None, 5), r"size must be in \[1, 4\], got \[5, 2\]"),
    (put("parents", 1, 0, 0), r"^invalid DraftTree: root parent != -1$"),
    (put("depth", 1, 0, 1), r"^invalid DraftTree: root depth != 0;"),
    (put("parents", 0, 3, 9), r"parents must precede children at \[\[0, 3\]\]"),  # out of range: no gather error
    (put("parents", 0, 2, 2), r"parents must precede children at \[\[0, 2\]\]"),  # itself
    (put("parents", 0, 3, 3), r"parents must precede children at \[\[0, 3\]\]"),
    (put("parents", 1, 1, -1), r"parents must precede children at \[\[1, 1\]\]"),  # a real node unlinked
    (put("depth", 0, 3, 1), r"depth != parent depth \+ 1 at \[\[0, 3\]\]"),
    (put("depth", 1, 1, 2), r"depth != parent depth \+ 1 at \[\[1, 1\]\]"),
    (put("logprob", 0, 3, -0.4), r"path logprob increases or is NaN at \[\[0, 3\]\]"),
    (put("logprob", 1, 1, float("nan")), r"path logprob increases or is NaN at \[\[1, 1\]\]"),
    (put("tokens", 0, 2, -3), r"negative token at \[\[0, 2\]\]"),
    (put("tokens", 1, 3, 6), r"^invalid DraftTree: padding must be token/parent/depth -1$"),
    (put("parents", 1, 2, 0), r"padding must be token/parent/depth -1"),
    (put("depth", 1, 2, 1), r"padding must be token/parent/depth -1"),
])
def test_check_names_each_broken_rule(edit, msg):
    with pytest.raises(ValueError, match=msg):
        DraftTree(**broken(edit)).check()


def test_check_reports_every_problem_and_the_depth_bound():
    f = broken(put("depth", 0, 0, 1))
    f["tokens"][1, 1] = -2
    with pytest.raises(ValueError, match=r"invalid DraftTree: root depth != 0; .*negative token at \[\[1, 1\]\]"):
        DraftTree(**f).check()
    with pytest.raises(ValueError, match=r"depth exceeds depth_bound=1"):
        DraftTree(**fields(good_tree()), depth_bound=1).check()
    DraftTree(**fields(good_tree()), depth_bound=2).check()  # the deepest node is at depth 2


@pytest.mark.parametrize("field, value, msg", [
    ("parents", 9, "parents must precede children"), ("depth", 7, r"depth != parent depth \+ 1"),
    ("logprob", 1.0, "path logprob increases or is NaN"), ("tokens", -2, "negative token")])
def test_check_lists_the_first_five_bad_nodes(field, value, msg):
    t = DraftTree.from_lists([[0] * 8], [[-1] + [0] * 7])
    f = fields(t)
    f[field][0, 1:] = value  # all 7 children broken
    with pytest.raises(ValueError, match=msg + r" at \[\[0, 1\], \[0, 2\], \[0, 3\], \[0, 4\], \[0, 5\]\]"):
        DraftTree(**f).check()


@pytest.mark.parametrize("delta, ok", [(0.0, True), (5e-6, True), (1e-5, True), (1e-3, False)])
def test_check_allows_rounding_in_the_path_logprob_only(delta, ok):
    f = fields(good_tree())
    f["logprob"][0, 3] = f["logprob"][0, 1] + delta  # the child of node 1
    if ok:
        DraftTree(**f).check()
    else:
        with pytest.raises(ValueError, match=r"path logprob increases"):
            DraftTree(**f).check()


@pytest.mark.parametrize("seed", range(4))
def test_check_accepts_random_valid_trees(seed):
    rng = random.Random(seed)
    lists = [random_tree_lists(rng, rng.randint(1, 9), vocab=6) for _ in range(3)]
    DraftTree.from_lists([t for t, _ in lists], [p for _, p in lists]).check()


# ------------------------------------------------------------------ from_lists
@pytest.mark.parametrize("tokens, parents, msg", [
    ([[1, 2]], [[-1, 0, 0]], r"request 0: tokens and parents differ in length"),
    ([[1], [1, 2]], [[-1], [0, 0]], r"request 1 node 0: parent 0 must be -1 for the root"),
    ([[1, 2]], [[-1, -1]], r"request 0 node 1: parent -1 must be -1 for the root and < 1"),
    ([[1, 2, 3]], [[-1, 0, 2]], r"request 0 node 2: parent 2 must be -1 for the root and < 2"),
])
def test_from_lists_rejects_bad_parents(tokens, parents, msg):
    with pytest.raises(ValueError, match=msg):
        DraftTree.from_lists(tokens, parents)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("with_logprob", [True, False])
def test_from_lists_matches_a_loop(seed, with_logprob):
    rng = random.Random(seed)
    lists = [random_tree_lists(rng, rng.randint(1, 8), vocab=5) for _ in range(rng.randint(1, 4))]
    toks, pars = [t for t, _ in lists], [p for _, p in lists]
    lps = [[-0.25 * i for i in range(len(t))] for t in toks] if with_logprob else None
    t = DraftTree.from_lists(toks, pars, lps)
    n = max(len(x) for x in toks)
    deps = []
    for ps in pars:
        d = []
        for p in ps:
            d.append(0 if p < 0 else d[p] + 1)
        deps.append(d)
    pad = lambda rows, fill: [r + [fill] * (n - len(r)) for r in rows]  # noqa: E731
    assert t.tokens.tolist() == pad(toks, -1) and t.parents.tolist() == pad(pars, -1)
    assert t.depth.tolist() == pad(deps, -1)
    want_lp = lps if with_logprob else [[0.0] * len(x) for x in toks]
    assert t.logprob.tolist() == pad(want_lp, NEG)
    assert t.size.tolist() == [len(x) for x in toks]
    assert t.depth_bound == max(max(d) for d in deps)
    assert t.tokens.dtype == t.parents.dtype == t.depth.dtype == t.size.dtype == torch.int64
    assert t.logprob.dtype == torch.float32


def test_from_lists_places_the_tree_on_the_device():
    t = DraftTree.from_lists([[1, 2]], [[-1, 0]], device="meta")
    assert t.device.type == "meta" and t.size.device.type == "meta" and t.depth_bound == 1


# ------------------------------------------------------------------ TreeBuffer
def test_empty_buffer_holds_the_roots_only():
    buf = TreeBuffer(torch.tensor([7, 3, 5]), capacity=4)
    assert buf.capacity == 4
    assert buf.tokens.tolist() == [[r, -1, -1, -1, -1] for r in (7, 3, 5)]  # capacity + the dump column
    assert buf.parents.tolist() == [[-1] * 5] * 3
    assert buf.depth.tolist() == [[0, -1, -1, -1, -1]] * 3
    assert buf.logprob.tolist() == [[0.0, NEG, NEG, NEG, NEG]] * 3
    assert buf.size.tolist() == [1, 1, 1]
    assert all(x.dtype == torch.int64 for x in (buf.tokens, buf.parents, buf.depth, buf.size))
    assert buf.logprob.dtype == torch.float32
    t = buf.view(depth_bound=0)
    t.check()
    assert t.depth_bound == 0
    assert t.n_nodes == 4 and t.paths() == [[(7,)], [(3,)], [(5,)]]


# ------------------------------------------------------------------ stack_rows / compact
def random_lists(rng, bs, max_n):
    lists = [random_tree_lists(rng, rng.randint(1, max_n), vocab=7) for _ in range(bs)]
    lps = [[-0.5 * d for d in range(len(t))] for t, _ in lists]  # index order never increases along a path
    return [t for t, _ in lists], [p for _, p in lists], lps


@pytest.mark.parametrize("seed", range(4))
def test_stack_rows_matches_a_loop(seed):
    rng = random.Random(seed)
    bs = rng.randint(2, 6)
    order = list(range(bs))
    rng.shuffle(order)
    cut = rng.randint(1, bs - 1)
    groups = [order[:cut], order[cut:]]
    parts, want = [], {}
    for rows in groups:
        toks, pars, lps = random_lists(rng, len(rows), 6)
        parts.append((torch.tensor(rows), DraftTree.from_lists(toks, pars, lps)))
        for r, t, p, lp in zip(rows, toks, pars, lps):
            want[r] = (t, p, lp)
    out = stack_rows(parts, bs)
    out.check()
    n = max(len(w[0]) for w in want.values())
    assert out.n_nodes == n
    assert out.depth_bound == max(t.depth_bound for _, t in parts)
    for r in range(bs):
        t, p, lp = want[r]
        assert out.tokens[r].tolist() == t + [-1] * (n - len(t))
        assert out.parents[r].tolist() == p + [-1] * (n - len(p))
        assert out.logprob[r].tolist() == lp + [NEG] * (n - len(lp))
        assert int(out.size[r]) == len(t)
    assert out.paths() == [DraftTree.from_lists([want[r][0]], [want[r][1]]).paths()[0] for r in range(bs)]


def test_stack_rows_of_one_group_in_order_is_that_tree():
    t = good_tree()
    assert stack_rows([(torch.arange(2), t)], 2) is t


def closed_keep(rng, parents):
    """A random ancestor-closed subset (root included) as a list of bools."""
    keep = [True]
    for i in range(1, len(parents)):
        keep.append(keep[parents[i]] and rng.random() < 0.7)
    return keep


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("slack", [0, 2, -1])
def test_compact_matches_a_loop(seed, slack):
    """Kept nodes renumbered in order, parents mapped to their new index; ``n_out`` below the kept count
    (slack -1) truncates to the first ``n_out`` kept nodes."""
    rng = random.Random(seed)
    toks, pars, lps = random_lists(rng, 3, 9)
    tree = DraftTree.from_lists(toks, pars, lps)
    keeps = [closed_keep(rng, p) for p in pars]
    keep = torch.tensor([k + [False] * (tree.n_nodes - len(k)) for k in keeps])
    n_out = max(max(sum(k) for k in keeps) + slack, 1)
    out = compact(tree, keep, n_out)
    for b in range(3):
        kept = [i for i in range(len(toks[b])) if keeps[b][i]][:n_out]
        new = {old: j for j, old in enumerate(kept)}
        pad = n_out - len(kept)
        assert out.tokens[b].tolist() == [toks[b][i] for i in kept] + [-1] * pad
        assert out.parents[b].tolist() == [new.get(pars[b][i], -1) for i in kept] + [-1] * pad
        assert out.logprob[b].tolist() == [lps[b][i] for i in kept] + [NEG] * pad
        deps = tree.depth[b].tolist()
        assert out.depth[b].tolist() == [deps[i] for i in kept] + [-1] * pad
        assert int(out.size[b]) == len(kept)
    assert out.depth_bound == min(tree.depth_bound, n_out - 1)
    out.check()


def test_buffer_gathers_depth_and_logprob_by_node_index_with_minus_one_for_none():
    buf = TreeBuffer(torch.tensor([7]), capacity=4)
    buf.append(torch.tensor([[3, 4]]), torch.tensor([[0, 0]]), torch.tensor([[-0.5, -1.5]]),
               torch.tensor([[True, True]]))
    buf.append(torch.tensor([[5]]), torch.tensor([[2]]), torch.tensor([[-2.0]]), torch.tensor([[True]]))
    idx = torch.tensor([[0, 3, -1, 2, 1]])
    assert buf.gather_depth(idx).tolist() == [[0, 2, -1, 1, 1]]
    assert buf.gather_logprob(idx).tolist() == [[0.0, -2.0, NEG, -1.5, -0.5]]
