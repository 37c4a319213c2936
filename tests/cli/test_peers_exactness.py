"""The transformers peer against our plain decoding (float32: token for token), and the bf16
near-tie check of divergent outputs."""

import pytest
import torch

from tests.models.tiny import make_tiny_llama
from treespec_sglang.engine.runs import PolicyRun, verdict
from treespec_sglang.engine import SpecEngine
from treespec_sglang.engine.exactness import TIE_BOUND, compare_outputs, divergence_margin, first_divergence
from treespec_sglang.engine.kv_cache import prefill

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_llama(path, vocab=64, hidden=48, layers=2, heads=4, kv_heads=2, seed=4)
    return str(path)


def test_hf_peer_greedy_equals_our_plain_decoding(tiny):
    from treespec_sglang.cli.peers import HFPeer

    e = SpecEngine.from_pretrained(tiny, draft=None, dtype="float32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 7, 12)]
    ours = [r.token_ids for r in e.generate(prompts, max_new_tokens=12)]
    peer = HFPeer(tiny, torch.float32, eos_ids=[])
    run = peer.run("hf-greedy", prompts, 12)
    assert run.outputs == ours and run.new_tokens == 36 and run.tokens_per_s > 0
    lookup = peer.run("hf-lookup", prompts, 12, lookup=3)
    assert lookup.outputs == ours  # prompt lookup is lossless in float32 too


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1 and first_divergence([], [1]) is None


def test_margin_is_the_target_logit_gap_at_the_first_divergence(tiny):
    e = SpecEngine.from_pretrained(tiny, draft=None, dtype="float32")
    prompt = [5, 9, 2]
    ref = e.generate([prompt], max_new_tokens=4)[0].token_ids
    with torch.no_grad():
        _, _, h, _ = prefill(e.target, [prompt + ref[:2]], 5)
    logits = e.calls.logits(h[0, -1])
    second = int(logits.topk(2).indices[1])
    other = ref[:2] + [second, 0]
    m = divergence_margin(e, prompt, ref, other)
    assert m == pytest.approx(float(logits[ref[2]] - logits[second]), abs=1e-5) and m > 0
    assert divergence_margin(e, prompt, ref, ref) is None
    c = compare_outputs(e, [prompt, prompt], [ref, ref], [ref, other])
    assert c["diverged"] == 1 and c["max_margin"] == pytest.approx(m, abs=1e-5) and not c["same"]
    assert c["ok"] == (m <= TIE_BOUND)


def test_verdict_strict_in_float32_tolerant_of_bf16_near_ties(tiny):
    from types import SimpleNamespace

    def run(spec, toks):
        return PolicyRun(spec, 1.0, [SimpleNamespace(token_ids=t, error=None) for t in toks])

    e32 = SpecEngine.from_pretrained(tiny, draft=None, dtype="float32")
    prompt = [5, 9, 2]
    ref = e32.generate([prompt], max_new_tokens=4)[0].token_ids
    spec = {"policy": "chain", "length": 2}
    assert verdict(e32, [prompt], run(None, [ref]), run(spec, [ref]), 0.0) == "yes"
    far = ref[:1] + [(ref[1] + 1) % 64] + ref[2:]
    assert verdict(e32, [prompt], run(None, [ref]), run(spec, [far]), 0.0) == "NO"  # float32: bit-exact or bust
    e16 = SpecEngine.from_pretrained(tiny, draft=None, dtype="bfloat16")
    ref16 = e16.generate([prompt], max_new_tokens=4)[0].token_ids
    with torch.no_grad():
        _, _, h, _ = prefill(e16.target, [prompt + ref16[:1]], 4)
    logits = e16.calls.logits(h[0, -1])
    order = logits.argsort(descending=True).tolist()
    near = next(t for t in order[1:] if float(logits[ref16[1]] - logits[t]) <= TIE_BOUND) \
        if float(logits[order[0]] - logits[order[1]]) <= TIE_BOUND else None
    worst = order[-1]
    v = verdict(e16, [prompt], run(None, [ref16]), run(spec, [ref16[:1] + [worst, 0, 0]]), 0.0)
    assert v.startswith("NO (margin")
    if near is not None:
        assert verdict(e16, [prompt], run(None, [ref16]), run(spec, [ref16[:1] + [near, 0, 0]]), 0.0).startswith("yes (bf16")
