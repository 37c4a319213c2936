"""TALF: the target's trees == a brute-force beam over plain causal forwards; the draft's tree pass ==
the inference-time draft chain along every branch; training on the trees raises held-out acceptance."""

import json
import os
import re

import pytest
import torch

from tests.models.tiny import make_tiny_llama
from tests.engines import alpha_before_after, chain_draft, distill_random_prompts
from treespec_sglang.engine import SpecEngine
from treespec_sglang.training.data import iter_sequences, load_shards, target_hidden
from treespec_sglang.training.talf import (batch_trees, generate_talf_trees, load_trees, loss_positions,
                                          talf_forward, target_tree)
from treespec_sglang.training.trainer import TrainConfig, batch_sequences

pytest.importorskip("transformers")

SEQ = [3, 9, 4, 17, 22, 5, 8, 30, 2, 11, 6, 40]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_llama(path, vocab=48, hidden=32, layers=2, heads=4, kv_heads=2, seed=3)
    return SpecEngine.from_pretrained(str(path), draft=None, seed=0, dtype="float32")


def brute_tree(e, seq, t, k, depth):
    """EAGLE-2 beam with the target, every node's law from a plain causal forward of prefix + branch."""
    def law(path):
        h = target_hidden(e.target, [seq[:t + 2] + path])[0][-1]
        return h, torch.log_softmax(e.target.lm_head(h), -1)

    _, root = law([])
    lp, tok = root.topk(k)
    level = [([int(c)], float(v)) for c, v in zip(tok, lp)]
    toks, pars, hids = [], [], []
    toks.append([p[-1] for p, _ in level])
    pars.append([0] * k)
    hids.append([law(p)[0] for p, _ in level])
    for _ in range(depth - 2):
        cand = []
        for i, (path, v) in enumerate(level):
            clp, ctok = law(path)[1].topk(k)
            cand += [(v + float(c_lp), i, path + [int(c)]) for c_lp, c in zip(clp, ctok)]
        best = sorted(cand, key=lambda x: -x[0])[:k]
        level = [(p, v) for v, _, p in best]
        toks.append([p[-1] for _, _, p in best])
        pars.append([i for _, i, _ in best])
        hids.append([law(p)[0] for _, _, p in best])
    return torch.tensor(toks), torch.tensor(pars), torch.stack([torch.stack(h) for h in hids])


@pytest.mark.parametrize("k,depth,chunk", [(2, 3, 128), (3, 4, 4), (1, 2, 2)])
def test_target_tree_equals_brute_force_beam(engine, k, depth, chunk):
    seq = torch.tensor(SEQ)
    mask = torch.tensor([False] * 4 + [True] * (len(SEQ) - 4))
    pos = loss_positions(len(SEQ), mask)
    assert pos.tolist() == list(range(2, len(SEQ) - 2))
    with torch.no_grad():
        nt, np_, nh = target_tree(engine.target, seq, pos, topk=k, depth=depth, chunk=chunk)
        assert nt.shape == (len(pos), depth - 1, k) and nh.shape == (len(pos), depth - 1, k, 32)
        for i, t in enumerate(pos.tolist()):
            bt, bp, bh = brute_tree(engine, SEQ, t, k, depth)
            assert torch.equal(nt[i], bt) and torch.equal(np_[i], bp), (t, nt[i], bt)
            torch.testing.assert_close(nh[i], bh, rtol=1e-4, atol=1e-4)


def test_draft_tree_pass_equals_the_inference_chain_on_every_branch(engine):
    """Node (t, level l, j) == the draft run over committed pairs 0..t (real features) and then the
    branch root -> node fed its own features: what that node sees at inference."""
    e = engine
    seq = torch.tensor(SEQ)
    mask = torch.tensor([False] * 3 + [True] * (len(SEQ) - 3))
    h = target_hidden(e.target, [SEQ])[0]
    with torch.no_grad():
        tree = target_tree(e.target, seq, loss_positions(len(SEQ), mask), topk=3, depth=4)
        items = [(seq, h, mask, tree)]
        tok, hid, msk, lens = batch_sequences(items, 64)
        ntok, npar, nhid, has = batch_trees(items, tok.shape[1] - 2, 64)
        f0, ok, levels = talf_forward(e.draft, tok, hid, msk, lens, ntok, npar, has)
        assert torch.equal(ok[0], has[0]) and has[0].sum() == len(SEQ) - 3
        for t in torch.nonzero(has[0]).flatten().tolist():
            toks, feats = SEQ[1:t + 2], [h[s] for s in range(t + 1)]
            root = chain_draft(e, toks, feats)[-1]
            torch.testing.assert_close(f0[0, t], root, rtol=1e-4, atol=1e-4)
            for lvl in range(3):
                for j in range(3):
                    path, i = [], j  # walk up to the root: tokens of the branch, root-first
                    for m in range(lvl, -1, -1):
                        path.insert(0, int(ntok[0, t, m, i]))
                        i = int(npar[0, t, m, i])
                    bt, bf, prev = list(toks), list(feats), root
                    for c in path:
                        bt, bf = bt + [c], bf + [prev]
                        prev = chain_draft(e, bt, bf)[-1]
                    torch.testing.assert_close(levels[0, t, lvl, j], prev, rtol=1e-4, atol=1e-4)


def test_talf_training_raises_heldout_acceptance(engine, tmp_path):
    e, d, t = engine, str(tmp_path / "d"), str(tmp_path / "t")
    distill_random_prompts(e, d)
    man = generate_talf_trees(e.target, d, t, topk=3, depth=3, progress=False)
    assert man["nodes"] == 24 * 16 * 2 * 3  # one loss position per answer token (it is x_{t+2})
    again = generate_talf_trees(e.target, d, t, topk=3, depth=3, progress=False)
    assert again["shards"] == man["shards"]  # resumable: nothing recomputed
    with pytest.raises(ValueError, match="topk=3 depth=3"):
        generate_talf_trees(e.target, d, t, topk=4, depth=3, progress=False)
    seqs = [s + (tr,) for s, tr in zip(iter_sequences(load_shards(d)), load_trees(t))]
    cfg = TrainConfig(loss="talf", steps=60, lr=1e-2, batch_size=4, ttt_steps=2, eval_every=60)
    before, after = alpha_before_after(e, seqs[:20], seqs[20:], cfg)
    assert after[0] > before[0] + 0.1 and after[1] > before[1] + 0.05, (before, after)


def _trees_and_pass_on(engine, dev):
    """The target's beam trees and the TALF tree pass run on ``dev`` against the same on the CPU."""
    import copy

    seq = torch.tensor(SEQ)
    msk = torch.tensor([False] * 4 + [True] * (len(SEQ) - 4))
    pos = loss_positions(len(SEQ), msk)
    moved = copy.deepcopy(engine.target).to(dev)
    with torch.no_grad():
        cpu = target_tree(engine.target, seq, pos, topk=3, depth=4)
        got = target_tree(moved, seq, pos, topk=3, depth=4)
    assert all(x.device.type == "cpu" for x in got)  # stored from the host
    assert torch.equal(cpu[0], got[0]) and torch.equal(cpu[1], got[1])
    torch.testing.assert_close(got[2], cpu[2], rtol=1e-4, atol=1e-4)
    h = target_hidden(engine.target, [SEQ])[0][None]  # [1, T, hidden]
    n = len(SEQ) - 2
    nt, np_, _, has = batch_trees([(seq, h[0], msk, cpu)], n, 64)
    args = (seq[None], h, msk[None], torch.tensor([len(SEQ)]), nt, np_, has)
    head = copy.deepcopy(engine.draft)
    with torch.no_grad():
        want = talf_forward(head, *args)
        # the head shares the target's embedding (attached, not a submodule): .to() leaves it, so attach the moved one
        out = talf_forward(copy.deepcopy(head).to(dev).attach(moved.model.embed_tokens), *(a.to(dev) for a in args))
    assert out[2].shape[2] == 3 and out[0].device.type == torch.device(dev).type  # 3 levels below the root
    for a, b in zip(want, out):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-4)


def test_target_trees_and_the_talf_pass_follow_the_model_device_on_the_cpu(engine):
    """The device plumbing of ``train trees --device`` (every index tensor on the model's device, results
    back on the host) runs here with the device the CPU; the GPU twin below checks a real move."""
    _trees_and_pass_on(engine, "cpu")


@pytest.mark.gpu
def test_target_trees_and_the_talf_pass_on_cuda_equal_the_cpu_ones(engine):
    """``train trees --device cuda``: the target's beam trees built on a GPU are the CPU's (same tokens and
    parents, states within float32 rounding), and the TALF tree pass over them runs on the GPU too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _trees_and_pass_on(engine, "cuda")


def test_talf_trees_manifest_defaults_and_resume(engine, tmp_path, capsys):
    """Defaults: App. D's k = 4, depth 3, a progress bar over the sequences. The manifest names the data and
    the shards, on disk as returned; the stored trees are the target's beams (node parents as int8). A run that
    lost its second shard rebuilds that one only, the bar still counting every sequence once."""
    e, d, t = engine, tmp_path / "d", tmp_path / "t"
    distill_random_prompts(e, d, n=12, max_new_tokens=6)  # shards of 8 and 4 sequences
    man = generate_talf_trees(e.target, str(d), str(t))
    bar = capsys.readouterr().err
    assert re.search(r"(^|\r)talf trees: ", bar) and "12/12" in bar and "seq/s" in bar
    names = ["trees-00000.safetensors", "trees-00001.safetensors"]
    assert (man["format"], man["data"], man["topk"], man["depth"], man["shards"]) == (
        "treespec-talf-trees-v1", os.path.abspath(d), 4, 3, names)
    shard_bytes = sum(os.path.getsize(t / n) for n in names)
    assert shard_bytes <= man["bytes"] <= shard_bytes + os.path.getsize(t / "trees.json")
    assert json.loads((t / "trees.json").read_text()) == man
    seqs = iter_sequences(load_shards(str(d)))
    trees = load_trees(str(t))
    assert len(trees) == len(seqs) == 12 and man["nodes"] == sum(len(x[0]) for x in trees) * 2 * 4
    for (tok, _, msk), (nt, np_, nh) in zip(seqs, trees):
        want = target_tree(e.target, tok, loss_positions(tok.shape[0], msk))
        assert np_.dtype == torch.int8 and torch.equal(nt.long(), want[0]) and torch.equal(np_.long(), want[1])
        torch.testing.assert_close(nh.float(), want[2], rtol=1e-3, atol=1e-3)  # stored as float16
    first = os.path.getmtime(t / names[0])
    (t / names[1]).unlink()
    (t / "trees.json").write_text(json.dumps(dict(man, shards=names[:1])))
    again = generate_talf_trees(e.target, str(d), str(t))
    bar = capsys.readouterr().err
    assert "12/12" in bar and "13/12" not in bar and again["shards"] == names
    assert os.path.getmtime(t / names[0]) == first  # not rebuilt
    for a, b in zip(load_trees(str(t)), trees):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    small = generate_talf_trees(e.target, str(d), str(tmp_path / "t2"), topk=2, depth=2, progress=False)
    assert (small["topk"], small["depth"]) == (2, 2)
    assert all(x[0].shape[1:] == (1, 2) for x in load_trees(str(tmp_path / "t2")))  # one level of 2 nodes
    with pytest.raises(FileNotFoundError, match=r"t3: no TALF trees \(run `treespec train trees` first\)$"):
        load_trees(str(tmp_path / "t3"))


def test_batch_trees_drop_the_positions_past_max_len(engine):
    """A position t takes its tree only where x_{t+2} fits in ``max_len``: t < max_len - 2 (and t < n)."""
    seq = torch.tensor(SEQ)
    msk = torch.tensor([False] * 3 + [True] * (len(SEQ) - 3))
    with torch.no_grad():
        tree = target_tree(engine.target, seq, loss_positions(len(SEQ), msk), topk=2, depth=3)
    h = target_hidden(engine.target, [SEQ])[0]
    for max_len, n in ((8, 10), (64, 10), (64, 7)):
        tok, par, hid, has = batch_trees([(seq, h, msk, tree)], n, max_len)
        pos = [p for p in loss_positions(len(SEQ), msk).tolist() if p < min(n, max_len - 2)]
        assert torch.nonzero(has[0]).flatten().tolist() == pos
        for i, p in enumerate(pos):
            assert torch.equal(tok[0, p], tree[0][i]) and torch.equal(par[0, p], tree[1][i])


def test_talf_pass_takes_no_loss_past_a_sequence_and_runs_without_levels(engine):
    """A root position past a sequence's length takes no loss even where its mask says otherwise; trees with no
    level below the root give an empty level tensor of the right shape."""
    e = engine
    bs, T, k = 2, 8, 2
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 48, (bs, T), generator=g)
    hid = torch.randn(bs, T, 32, generator=g)
    mask = torch.ones(bs, T, dtype=torch.bool)
    lens = torch.tensor([T, 5])
    n = T - 2
    for L in (1, 0):
        nt = torch.randint(0, 48, (bs, n, L, k), generator=g)
        npar = torch.zeros(bs, n, L, k, dtype=torch.long)
        with torch.no_grad():
            f0, ok, levels = talf_forward(e.draft, tok, hid, mask, lens, nt, npar, torch.ones(bs, n, dtype=torch.bool))
        assert ok.tolist() == [[True] * n, [t + 2 < 5 for t in range(n)]]
        assert f0.shape == (bs, n, 32) and levels.shape == (bs, n, L, k, 32)
