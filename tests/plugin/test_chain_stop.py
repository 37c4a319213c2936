"""C2T early stop for chain drafting: per-row lengths vs a plain loop, and TP-rank agreement
(two processes over torch.distributed gloo, decisions broadcast from rank 0)."""

import os

import torch

from tests.helpers import GlooGroup, run_ranks
from treespec_sglang.plugin.chain_stop import ChainStopper
from treespec_sglang.policies import parse_spec
from treespec_sglang.policies.classifier import entropy_topm, load_classifier

S, V = 6, 40


def step_logits(seed, bs=4):
    g = torch.Generator().manual_seed(seed)
    sharp = torch.tensor([6.0, 2.0, 0.5, 6.0])[:bs, None]  # confident rows run longer
    return [torch.randn(bs, V, generator=g) * sharp for _ in range(S - 1)]


PARAMS = [{"policy": "chain", "length": 6, "beta": 0.5}, {"policy": "chain", "length": 6, "beta": 0.5},
          None, {"policy": "chain", "length": 3, "beta": 0.5}]


def test_lengths_match_a_plain_loop():
    params = [parse_spec(p) if p else None for p in PARAMS]
    st = ChainStopper(params, S, "cpu")
    logits = step_logits(0)
    for lg in logits:
        st.observe(lg)
    clf = load_classifier(None)
    for b, p in enumerate(params):
        if p is None:
            assert int(st.length[b]) == S and int(st.keep_mask(S + 1)[b].sum()) == S + 1
            continue
        length, logp = 1, 0.0
        for d, lg in enumerate(logits, start=2):
            lp = torch.log_softmax(lg[b], -1)
            logp += float(lp.max())
            with torch.no_grad():
                score = float(clf(torch.tensor([torch.tensor(logp).exp().item(), float(entropy_topm(lp)), float(d)])))
            if score < 0.5 or d > p.length:
                break
            length += 1
        assert int(torch.minimum(st.length, st.max_len)[b]) == length, b
    assert st.length.tolist() != [S] * 4  # some row stopped early


def _rank_main(rank, out):
    params = [parse_spec(p) if p else None for p in PARAMS]
    st = ChainStopper(params, S, "cpu")
    for lg in step_logits(0):
        if rank == 1:  # another rank's logits differ slightly (non-deterministic kernels)
            lg = lg + 3.0 * torch.randn(lg.shape, generator=torch.Generator().manual_seed(9))
        st.observe(lg)
    local = torch.minimum(st.length, st.max_len)
    agreed = st.keep_mask(S + 1, GlooGroup()).long().sum(-1) - 1
    torch.save({"local": local, "agreed": agreed}, os.path.join(out, f"rank{rank}.pt"))


def test_two_ranks_agree_on_rank0_decisions(tmp_path):
    run_ranks(_rank_main, 2, tmp_path, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))
    assert torch.equal(r0["agreed"], r1["agreed"]) and torch.equal(r0["agreed"], r0["local"])
    assert not torch.equal(r0["local"], r1["local"]), "the ranks' own decisions should differ in this case"


def test_chain_mode_hooks_cut_each_row(monkeypatch):
    """The draft hook in chain mode (topk 1): each draft forward's logits feed the stopper, and the
    verify input keeps each row's chain up to its cut; stats land in customized_info once flushed."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import hooks
    from treespec_sglang.tree import DraftTree, sglang_retrive

    monkeypatch.delenv("TREESPEC_POLICY", raising=False)
    N = S + 1
    logits = step_logits(0)
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(custom_params={"treespec": p} if p else None),
                            customized_info=None) for p in PARAMS]

    def model_forward(self, fb):
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits[fb]))

    def body(self, batch):
        for i in range(S - 1):
            hooks._runner_forward(model_forward, None, i)
        chain = DraftTree.from_lists([list(range(N))] * 4, [[-1] + list(range(N - 1))] * 4)
        r = sglang_retrive(chain)
        return hooks._verify_input(SimpleNamespace(retrieve_next_token=r.retrive_next_token.clone(),
                                                   retrieve_next_sibling=r.retrive_next_sibling.clone()))

    worker = SimpleNamespace(topk=1, speculative_num_steps=S, speculative_num_draft_tokens=N, device="cpu")
    out = hooks._draft(body, worker, SimpleNamespace(reqs=reqs))
    ref = ChainStopper([parse_spec(p) if p else None for p in PARAMS], S, "cpu")
    for lg in logits:
        ref.observe(lg)
    lengths = torch.minimum(ref.length, ref.max_len).tolist()
    for b in range(4):
        walk, u = [0], 0
        while int(out.retrieve_next_token[b, u]) >= 0:
            u = int(out.retrieve_next_token[b, u])
            walk.append(u)
        assert walk == list(range(lengths[b] + 1)), b
    assert reqs[0].customized_info is None  # recorded when SGLang resolves the round (no device read here)
    hooks._PENDING.flush()
    assert reqs[0].customized_info["treespec_tree_sizes"] == [lengths[0] + 1]
    assert reqs[2].customized_info is None
    # outside a draft step the model-forward hook is a pass-through
    assert hooks._runner_forward(model_forward, None, 0).logits_output.next_token_logits is logits[0]
