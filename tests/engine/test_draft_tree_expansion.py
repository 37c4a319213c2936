"""The engine's tree expansion against a chain oracle: for every expanded node u, the draft's
output equals running the draft from scratch, causally, over the committed pairs followed by the
pairs on u's branch ((draft feature of the parent, token) at prefix + depth). This pins down
positions, masks, the tree-region KV and the feature routing in one check."""

import pytest
import torch

from tests.engines import chain_draft
from tests.models.tiny import make_tiny_llama
from treespec_sglang.models import LlamaModel
from treespec_sglang.engine import KVCache, SpecEngine
from treespec_sglang.engine.expander import TreeExpander
from treespec_sglang.policies import grow_tree
from treespec_sglang.tree import DraftTree

pytest.importorskip("transformers")


def _committed(e, ids):
    """Prefill ``ids`` and the draft over them: (draft cache, lens, root features ``[bs, hidden]``, root log-probs,
    roots ``[bs]``, each request's committed (tokens, target features) for the chain oracle)."""
    cache, inp, hidden, lens, logits = e.calls.prefill(ids, 40)
    dcfg = e.draft.config
    dcache = KVCache(1, len(ids), dcfg.num_key_value_heads, 41, dcfg.head_dim, torch.float32, "cpu")
    root = logits.argmax(-1)
    toks = torch.cat([inp[:, 1:], torch.zeros_like(inp[:, :1])], dim=1)
    toks.scatter_(1, (lens - 1)[:, None], root[:, None])
    f_root, root_lp = e.calls.draft_extend(dcache, toks, hidden, torch.ones_like(lens), lens, kv=inp.shape[1] + 1)
    committed = [(x[1:] + [int(root[b])], [hidden[b, p] for p in range(len(x))]) for b, x in enumerate(ids)]
    for b, (tok, feat) in enumerate(committed):
        torch.testing.assert_close(chain_draft(e, tok, feat)[-1], f_root[b], rtol=1e-5, atol=1e-5)
    return dcache, lens, f_root, root_lp, root, committed


def _branch_feature(e, tree, b, u, committed, memo, token_map=None):
    """Node u's draft feature by the chain oracle: the draft from scratch over request b's committed pairs,
    then the pairs on u's branch (parent's feature, u's target id: ``token_map[draft id]`` with a map).
    ``memo`` starts as {0: the root's feature}."""
    if u not in memo:
        branch, i = [], u
        while i > 0:
            branch.append(i)
            i = int(tree.parents[b, i])
        branch.reverse()
        ids = [int(tree.tokens[b, j]) for j in branch]
        toks = committed[0] + (ids if token_map is None else [int(token_map[t]) for t in ids])
        feats = committed[1] + [_branch_feature(e, tree, b, int(tree.parents[b, j]), committed, memo, token_map)
                                for j in branch]
        memo[u] = chain_draft(e, toks, feats)[-1]
    return memo[u]


def _oracle_logprobs(e, feature, token_map=None):
    logits = e.target.lm_head(feature)
    return torch.log_softmax(logits if token_map is None else logits[token_map], -1)


@pytest.fixture(scope="module")
def chain_engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("expansion")
    make_tiny_llama(path, vocab=40, hidden=32, layers=2, heads=4, kv_heads=2)
    return SpecEngine.from_pretrained(str(path), draft=None, seed=5, dtype="float32")


@pytest.mark.parametrize("prune", [False, True])
@pytest.mark.parametrize("spec", [{"policy": "eagle2", "budget": 12, "topk": 3, "depth": 4},
                                  {"policy": "talon", "budget": 12, "topk": 3, "mu": 0.01}])
def test_expansion_equals_branch_chain(chain_engine, spec, prune):
    """prune: draft pruning (grow_tree min_logprob) with the ragged expander, which runs the draft on the
    live frontier nodes only: every live node's output still equals the chain oracle, pruned rows are -inf."""
    e = chain_engine
    ids = [[3, 7, 1, 9, 4], [5, 2]]
    with torch.no_grad():
        dcache, lens, f_root, root_lp, root, committed = _committed(e, ids)
        exp = TreeExpander(e.calls, dcache, lens, f_root, max(len(x) for x in ids), ragged=prune)
        seen = []

        class Recording:
            ragged = exp.ragged

            def __call__(self, tree, frontier, n_live=None):
                out = exp(tree, frontier, n_live)
                seen.append((tree, frontier.clone(), out.clone()))
                return out

        # pruning: each request expands only what is at least as likely as its root's second child
        min_lp = root_lp.topk(2, -1).values[:, 1] - 1e-6 if prune else None
        grow_tree([spec, spec], root, root_lp, Recording(), min_logprob=min_lp)
        assert seen, "the policy expanded nothing"
        if prune:
            assert any(bool((f < 0).any()) for _, f, _ in seen), "nothing was pruned: the ragged path is untested"
            for _, f, out in seen:
                assert torch.isneginf(out[f < 0]).all()
        for b in range(len(ids)):
            memo = {0: f_root[b]}
            checked = 0
            for tree, frontier, out in seen:
                for w, u in enumerate(frontier[b].tolist()):
                    if u < 0:
                        continue
                    ref = _oracle_logprobs(e, _branch_feature(e, tree, b, u, committed[b], memo))
                    torch.testing.assert_close(out[b, w], ref, rtol=1e-5, atol=1e-5)
                    checked += 1
            assert checked >= (2 if prune else 3)


# draft ids 0..9 -> target ids; id 6 is target 0, no id is its own target id
TOKEN_MAP = torch.tensor([17, 4, 29, 11, 35, 8, 0, 23, 2, 31])


@pytest.mark.parametrize("token_map", [None, TOKEN_MAP], ids=["full-vocab", "token-map"])
def test_hand_built_frontiers_equal_branch_chain(chain_engine, token_map):
    """Frontiers the policies rarely hand over, each node against the chain oracle: a padding slot beside a
    live node (its write-back must leave the root's feature slot as it was: a depth-1 node expanded in the
    next call reads it), depth-1 nodes expanded after depth-2 ones exist, and token id 0 in the trees (as the
    target's id 0, and with a reduced draft vocabulary, as draft id 0 and as the draft id that maps to target 0).
    Every non-root token is a draft id mapped by the oracle itself, depth-1 nodes included."""
    e = chain_engine
    ids = [[3, 7, 1, 9, 4], [5, 2]]
    # request 0: 1 and 2 under the root, 3 under 1, 4 under 3, 5 under 2; request 1: 1 under the root, 2 under 1
    tokens = [[-7, 0, 6, 6, 3, 0], [-7, 6, 0]]
    parents = [[-1, 0, 0, 1, 3, 2], [-1, 0, 1]]
    frontiers = [[[1, -1], [-1, 1]],  # live nodes beside padding, in either slot
                 [[3, 2], [2, -1]],  # a depth-2 node beside a depth-1 one
                 [[-1, 5], [-1, -1]],  # a whole padding row
                 [[4, -1], [-1, -1]]]
    e.set_token_map(token_map)
    try:
        with torch.no_grad():
            dcache, lens, f_root, _, root, committed = _committed(e, ids)
            tree = DraftTree.from_lists(tokens, parents)
            tree.tokens[:, 0] = root  # the root is a target id
            exp = TreeExpander(e.calls, dcache, lens, f_root, max(len(x) for x in ids))
            memos = [{0: f_root[b]} for b in range(len(ids))]
            for fr in frontiers:
                out = exp(tree, torch.tensor(fr))  # [bs, width, vocab_d]
                for b, row in enumerate(fr):
                    for w, u in enumerate(row):
                        if u >= 0:
                            ref = _oracle_logprobs(e, _branch_feature(e, tree, b, u, committed[b], memos[b], token_map),
                                                   token_map)
                            torch.testing.assert_close(out[b, w], ref, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(exp.feat[:, 0], f_root, rtol=0, atol=0)
    finally:
        e.set_token_map(None)


def test_draft_extend_after_verify_equals_chain_over_committed_tokens(tmp_path, monkeypatch):
    """Each round's root log-probs equal the draft run from scratch over all committed tokens with
    the target's real hidden states: accepted-path features and draft KV are committed right."""
    import treespec_sglang.engine.round as E
    from tests.engines import POLICIES

    make_tiny_llama(tmp_path, vocab=40, hidden=32, layers=1, heads=4, kv_heads=2, seed=2)
    e = SpecEngine.from_pretrained(str(tmp_path), draft=None, seed=1, dtype="float32")
    with torch.no_grad():  # make the draft agree with the target often (see test_engine.aligned_engine)
        H = e.draft.config.hidden_size
        e.draft.fc.weight.zero_()
        e.draft.fc.weight[:, :H] = torch.eye(H)
        e.draft.fc.weight[:, H:] = 0.1 * torch.eye(H)  # keep the feature path live
        e.draft.fc.bias.zero_()
        # the unfused layer (the engine fuses its target's q/k/v and gate/up; the draft keeps separate weights)
        layer = LlamaModel.from_pretrained(str(tmp_path)).model.layers[0]
        e.draft.layers[0].load_state_dict({k: v for k, v in layer.state_dict().items()
                                           if "input_layernorm" not in k}, strict=False)
    calls = []
    real = E.grow_tree

    def spy(specs, root, root_lp, expand, **kw):
        calls.append((root.clone(), root_lp.clone()))
        return real(specs, root, root_lp, expand, **kw)

    monkeypatch.setattr(E, "grow_tree", spy)
    prompt = [3, 7, 1, 9]
    out = e.generate([prompt], max_new_tokens=12, policy=POLICIES[0])[0]
    assert sum(out.stats.accepted) >= 2, "want multi-token acceptances in this check"
    seq = prompt + out.token_ids
    # rounds start after prefill (root = first token); round r's root sits at len(prompt) + sum(...)
    pos = len(prompt)
    with torch.no_grad():
        for r, (root, root_lp) in enumerate(calls):
            assert int(root[0]) == seq[pos]
            ctx = torch.tensor([seq[:pos]])
            cfg = e.target.config
            cache = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, pos, cfg.head_dim, torch.float32, "cpu")
            p = torch.arange(pos)[None]
            h = e.target(ctx, p, cache.stores(p, pos), torch.ones(pos, pos, dtype=torch.bool).tril()[None])[0]
            f = chain_draft(e, seq[1:pos + 1], [h[i] for i in range(pos)])[-1]
            ref = torch.log_softmax(e.target.lm_head(f), -1)
            torch.testing.assert_close(root_lp[0], ref, rtol=1e-5, atol=1e-5)
            if r < len(out.stats.accepted):
                pos += 1 + out.stats.accepted[r]
