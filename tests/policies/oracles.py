"""Plain-Python, one-request restatements of each policy: the oracles the batched code must match."""

from __future__ import annotations

import heapq
import math

import torch

from tests.helpers import plain_confidence, plain_entropy


class Nodes:
    """A growing single-request tree of (token, parent, logprob)."""

    def __init__(self, root):
        self.tok, self.par, self.lp = [root], [-1], [0.0]

    def add(self, t, p, lp):
        self.tok.append(t)
        self.par.append(p)
        self.lp.append(lp)
        return len(self.tok) - 1

    def path(self, i):
        out = []
        while i >= 0:
            out.append(self.tok[i])
            i = self.par[i]
        return tuple(reversed(out))


def sglang_eagle2(draft, root, topk, steps, num_draft_tokens):
    """SGLang 0.5.23 select_top_k_tokens + organize_draft_results + build_tree's parent lookup (bs = 1).

    Returns (tokens, parents) of the tree, root first, in SGLang's node order.
    """
    parent_list, top, draft_tokens = sglang_draft_pool(draft, root, topk, steps, num_draft_tokens)
    # build_tree_kernel_efficient: node i's parent
    sel = top[0].tolist()
    parents = [-1]
    for i in range(1, num_draft_tokens):
        tb = sel[i - 1] // topk
        pos = 0
        if tb > 0:
            ptok = int(parent_list[0, tb])
            pos = sel.index(ptok) + 1  # ValueError = invalid tree
        parents.append(pos)
    return [root] + draft_tokens[0].tolist(), parents


def sglang_draft_pool(draft, root, topk, steps, num_draft_tokens):
    """The draft loop + organize_draft_results: (parent_list, top_scores_index, draft_tokens), bs = 1."""
    k = topk
    probs0 = draft.logprobs((root,)).exp()
    topk_p, topk_index = probs0.topk(k)
    score_list = [topk_p[None, None]]  # [1, 1, k]
    token_list = [topk_index[None]]  # [1, k]
    parents_list = [torch.arange(-1, k)[None]]  # [1, k + 1]
    scores = topk_p[None]  # [1, k]
    paths = [(root, t) for t in topk_index.tolist()]  # stands in for the hidden states
    for i in range(1, steps):
        p = torch.stack([draft.logprobs(pp).exp() for pp in paths])  # draft forward, [k, V]
        tp, ti = p.topk(k, dim=-1)  # [k, k]
        expand_scores = scores[:, :, None] * tp[None]  # [1, k, k]
        cs_p, cs_index = expand_scores.flatten(1).topk(k)
        scores = cs_p
        flat_tok = ti.reshape(1, -1)
        paths = [paths[j // k] + (int(flat_tok[0, j]),) for j in cs_index[0].tolist()]
        score_list.append(expand_scores)
        token_list.append(flat_tok)
        parents_list.append(cs_index + (k ** 2 * (i - 1) + k))
    # organize_draft_results
    all_scores = torch.cat(score_list, dim=1).flatten(1)
    all_tokens = torch.cat(token_list, dim=1)
    top = torch.topk(all_scores, num_draft_tokens - 1, dim=-1).indices
    top = torch.sort(top).values
    draft_tokens = torch.gather(all_tokens, 1, top)
    parent_list = torch.cat(parents_list[:-1], dim=1) if len(parents_list) > 1 else torch.empty(1, 0, dtype=torch.long)
    return parent_list, top, draft_tokens


def sglang_build_tree_kernel(parent_list, selected_index, seq_lens, topk, depth, n):
    """Line-by-line restatement of the CUDA kernel ``build_tree_efficient`` (FULL_MASK mode)."""
    bs = len(seq_lens)
    mask = [True] * (sum(seq_lens) * n + n * n * bs)
    positions = [0] * (bs * n)
    ri, rnt, rns = [-1] * (bs * n), [-1] * (bs * n), [-1] * (bs * n)
    width = topk * (depth - 1) + 1
    for bid in range(bs):
        sel = selected_index[bid]
        seq_tree_idx = n * n * bid + sum(seq_lens[:bid]) * n
        seq_len = seq_lens[bid]
        for tid in range(n):
            token_tree_idx = seq_tree_idx + (seq_len + n) * tid + seq_len + 1
            mask[token_tree_idx - 1] = True
            for i in range(n - 1):
                mask[token_tree_idx + i] = False
            if tid == 0:
                positions[bid * n] = seq_len
                for i in range(n - 1, 0, -1):
                    ri[bid * n + i] = bid * n + i
                    parent_tb_idx = sel[i - 1] // topk
                    parent_position = 0
                    if parent_tb_idx > 0:
                        parent_token_idx = parent_list[bid][parent_tb_idx] if width else None
                        while parent_position < n:
                            if sel[parent_position] == parent_token_idx:
                                parent_position += 1
                                break
                            parent_position += 1
                    if parent_position == n:
                        continue
                    if rnt[bid * n + parent_position] == -1:
                        rnt[bid * n + parent_position] = i
                    else:
                        rns[bid * n + i] = rnt[bid * n + parent_position]
                        rnt[bid * n + parent_position] = i
                ri[bid * n] = bid * n
            else:
                cur, position = tid - 1, 0
                while True:
                    position += 1
                    mask[token_tree_idx + cur] = True
                    parent_tb_idx = sel[cur] // topk
                    if parent_tb_idx == 0:
                        break
                    token_idx = parent_list[bid][parent_tb_idx]
                    cur = next(c for c in range(n) if sel[c] == token_idx)
                positions[bid * n + tid] = position + seq_len
    return mask, positions, ri, rnt, rns


def talon(draft, root, N, K, mu):
    """TALON Alg. 2 over full candidate sets."""
    T = Nodes(root)
    layer, d = [0], 0
    while len(T.tok) < N and layer:
        S = []
        for v in layer:
            lp = draft.logprobs(T.path(v))
            S += [(T.lp[v] + float(lp[w]), v, w) for w in range(draft.vocab) if math.isfinite(float(lp[w]))]
        if not S:  # no layer node has a child (a beam-restricted draft)
            break
        if d == 0:
            P = sorted(S, key=lambda x: -x[0])[:K]
        else:
            m = max(s[0] for s in S)
            P = [s for s in S if mu > 0 and s[0] >= math.log(mu) + m or mu == 0]
        if len(T.tok) + len(P) > N:
            P = sorted(P, key=lambda x: -x[0])[:N - len(T.tok)]
        layer = [T.add(w, v, lp) for lp, v, w in P]
        d += 1
    return T


def salf(draft, root, N, B, th, max_depth=None):
    """SALF Alg. 2 with heaps; returns G as a Nodes tree (top-N of popped, in pop order)."""
    popped = Nodes(root)
    depth = [0]
    Q = []  # (-lp, seq, token, parent)
    seq = 0

    def push_children(n):
        nonlocal seq
        lp = draft.logprobs(popped.path(n))
        for w in range(draft.vocab):
            if math.isfinite(float(lp[w])):  # -inf: no such child (e.g. one the beam never computed)
                heapq.heappush(Q, (-(popped.lp[n] + float(lp[w])), seq, w, n))
                seq += 1
        while len(Q) > N:  # capacity N: drop the worst
            Q.remove(max(Q))
            heapq.heapify(Q)

    push_children(0)  # iteration 1 pops and expands the root
    while True:
        D = []
        for _ in range(B):
            if not Q:
                break
            nlp, _, w, par = heapq.heappop(Q)
            i = popped.add(w, par, -nlp)
            depth.append(depth[par] + 1)
            D.append(i)
        eps = -math.inf
        if len(popped.tok) >= N:
            eps = sorted(popped.lp, reverse=True)[N - 1]
        D = [i for i in D if popped.lp[i] > eps]  # line 12: what enters G
        if not D or sum(math.exp(popped.lp[i]) for i in D) < th:  # line 13
            break
        for i in D:
            if max_depth is None or depth[i] < max_depth:  # a node at the depth bound has no children
                push_children(i)
    keep = sorted(range(len(popped.tok)), key=lambda i: (-popped.lp[i] if i else -math.inf, i))[:N]
    return {popped.path(i) for i in keep}


def brute_force_top_n(draft, root, N):
    """Every node down to depth N-1, then the N best path probabilities (root counts as one)."""
    best = [(0.0, (root,))]
    frontier = [(0.0, (root,))]
    for _ in range(N - 1):
        nxt = []
        for lp0, path in frontier:
            lp = draft.logprobs(path)
            nxt += [(lp0 + float(lp[w]), path + (w,)) for w in range(draft.vocab)]
        best += nxt
        best = sorted(best, key=lambda x: -x[0])[:N]
        cutoff = best[-1][0] if len(best) >= N else -math.inf
        frontier = [x for x in nxt if x[0] > cutoff]  # descendants can only be worse
    return {p for _, p in best}


def c2t(draft, root, N, K, beta, max_depth, clf):
    """C2T App. A Alg. 1 (with the budget cap) over full candidate sets (entropy and score restated:
    :func:`tests.helpers.plain_entropy`, :func:`tests.helpers.plain_confidence`)."""
    T = Nodes(root)
    layer, d = [0], 1
    while layer and d <= max_depth and len(T.tok) < N:
        S = []
        for v in layer:
            lp = draft.logprobs(T.path(v))
            H = plain_entropy(lp)
            S += [(T.lp[v] + float(lp[w]), v, w, H) for w in range(draft.vocab) if math.isfinite(float(lp[w]))]
        S = sorted(S, key=lambda x: -x[0])[:K]  # stage 1: top-K by joint probability
        scored = []
        for lp, v, w, H in S:
            c = plain_confidence(clf, math.exp(lp), H, d)
            if c >= beta:
                scored.append((c, lp, v, w))
        scored = sorted(scored, key=lambda x: -x[0])[:min(K, N - len(T.tok))]
        layer = [T.add(w, v, lp) for _, lp, v, w in scored]
        d += 1
    return T


def sglang_pool_lists(draft, roots, topk, steps):
    """SGLang's draft loop (select_top_k_tokens, bs rows) -> (score_list, token_list, parents_list)
    exactly as organize_draft_results receives them, plus the path of every flat candidate."""
    k = topk
    bs = len(roots)
    probs0 = torch.stack([draft.logprobs((int(r),)).exp() for r in roots])  # [bs, V]
    topk_p, topk_index = probs0.topk(k, dim=-1)
    score_list = [topk_p[:, None, :]]
    token_list = [topk_index]
    parents_list = [torch.arange(-1, k).expand(bs, k + 1)]
    scores = topk_p
    flat_paths = [[(int(r), int(t)) for t in topk_index[b]] for b, r in enumerate(roots)]
    frontier = [list(p) for p in flat_paths]  # paths of the current frontier nodes
    for i in range(1, steps):
        p = torch.stack([torch.stack([draft.logprobs(pp).exp() for pp in frontier[b]]) for b in range(bs)])
        tp, ti = p.topk(k, dim=-1)  # [bs, k, k]
        expand_scores = scores[:, :, None] * tp
        cs_p, cs_index = expand_scores.flatten(1).topk(k, dim=-1)
        flat_tok = ti.reshape(bs, -1)
        for b in range(bs):
            flat_paths[b] += [frontier[b][j // k] + (int(flat_tok[b, j]),) for j in range(k * k)]
        frontier = [[frontier[b][j // k] + (int(flat_tok[b, j]),) for j in cs_index[b].tolist()] for b in range(bs)]
        scores = cs_p
        score_list.append(expand_scores)
        token_list.append(flat_tok)
        parents_list.append(cs_index + (k * k * (i - 1) + k))
    return score_list, token_list, parents_list, flat_paths


class BeamDraft:
    """A draft restricted to what SGLang's beam computed: a path's children are the k candidates
    the beam produced under it (true conditional probabilities), -inf elsewhere."""

    def __init__(self, draft, score_list, flat_paths, vocab):
        self.vocab = vocab
        self.children = {}
        scores = torch.cat(score_list, dim=1).flatten(1)
        for b, paths in enumerate(flat_paths):
            score_of = {p: float(scores[b, f]) for f, p in enumerate(paths)}
            for p in paths:
                parent = p[:-1]
                own = 1.0 if len(parent) == 1 else score_of[parent]
                self.children.setdefault(parent, {})[p[-1]] = math.log(score_of[p]) - math.log(own)

    def logprobs(self, path):
        out = torch.full((self.vocab,), float("-inf"))
        for t, lp in self.children.get(tuple(path), {}).items():
            out[t] = lp
        return out


class IntegerDraft:
    """A draft whose every node gives token w the log-prob -(w + 1): path values are exact integers in float32
    and in Python floats alike, so cousins and nodes of different depths tie exactly (e.g. -3 for the paths
    (2,), (0, 1), (1, 0) and (0, 0, 0)), while each row's values are distinct (its top-k order is defined).
    Ties then follow the algorithms' own order: older queue entries / earlier parents first, then child rank."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def logprobs(self, path):
        return -torch.arange(1, self.vocab + 1, dtype=torch.float32)

    def root(self, root_tokens):
        return torch.stack([self.logprobs((int(t),)) for t in root_tokens])

    def expand(self, tree, frontier):
        bs, w = frontier.shape
        return self.logprobs(()).expand(bs, w, self.vocab)
