"""oneDNN bf16 weight prepacking: the capability check agrees with the kernel on this CPU, and both of
its branches (pack where supported, plain ``nn.Linear`` where not) are exercised on every CPU."""

import pytest
import torch
import torch.nn.functional as F

import treespec_sglang.models.packing as P
from tests.models.tiny import make_tiny_llama
from treespec_sglang.engine import KVCache, SpecEngine
from treespec_sglang.models import LlamaModel

pytest.importorskip("transformers")

N_LINEARS = 2 * 7 + 1  # tiny llama: 2 layers x (q, k, v, o, gate, up, down) + the LM head


def _forward(model, ids):  # ids: [bs, T] -> logits [bs, T, vocab]
    cfg, (bs, T) = model.config, ids.shape
    cache = KVCache(cfg.num_hidden_layers, bs, cfg.num_key_value_heads, T, cfg.head_dim, torch.bfloat16, "cpu")
    pos = torch.arange(T).expand(bs, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril().expand(bs, T, T)
    with torch.inference_mode():
        return model.lm_head(model(ids, pos, cache.stores(pos, T), mask))


@pytest.fixture
def capability(monkeypatch):
    """Force :func:`onednn_bf16_supported` to an answer; with ``kernel`` also swap the two oneDNN ops for
    a plain-torch stand-in (the reorder keeps the plain layout), so the "supported" branch runs on a CPU
    that lacks the real kernel."""
    def force(supported, kernel=None):
        monkeypatch.setattr(P, "onednn_bf16_supported", lambda: (supported, "" if supported else "forced off"))
        if kernel is not None:
            monkeypatch.setattr(P, "_reorder", lambda w, hint: w.clone())
            monkeypatch.setattr(P, "_packed_linear", kernel)
    return force


def test_the_check_agrees_with_the_kernel_on_this_cpu():
    """Whatever this CPU is: where the check says yes, the real packed op equals ``nn.Linear`` bit for bit
    at every M; where it says no, the raw oneDNN op really refuses (or differs), so the "no" is not a guess."""
    ok, why = P.onednn_bf16_supported()
    assert P.packing_available(torch.bfloat16, "cpu") == ok
    assert not P.packing_available(torch.float32, "cpu") and not P.packing_available(torch.bfloat16, "meta")
    for bias in (False, True):
        lin = torch.nn.Linear(48, 80, bias=bias).to(torch.bfloat16)
        if ok:
            p = P.PackedLinear(lin)
            with torch.inference_mode():
                for shape in [(1, 48), (3, 1, 48), (2, 17, 48), (130, 48)]:
                    x = torch.randn(shape).to(torch.bfloat16)
                    assert torch.equal(p(x), lin(x)), shape
        else:
            assert why
            try:
                w = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 16)
                x = torch.randn(5, 48).to(torch.bfloat16)
                y = torch.ops.mkldnn._linear_pointwise(x, w, lin.bias, "none", [], "")
                assert not torch.equal(y, lin(x).detach())
            except (RuntimeError, AttributeError):
                pass  # the kernel refuses this CPU, as the check said


@pytest.mark.parametrize("branch", ["supported", "unsupported", "kernel differs"])
def test_pack_linears_follows_the_check(tmp_path, capability, branch):
    """Supported: every linear is packed and the model is bit-identical to the plain one. Unsupported:
    nothing is packed (plain ``nn.Linear``, no oneDNN call at all). A kernel that differs from
    ``nn.Linear`` on the probe is refused linear by linear."""
    calls = []

    def kernel(x, w, b):
        calls.append(1)
        y = F.linear(x, w, b)
        return y * 1.01 if branch == "kernel differs" else y

    capability(branch != "unsupported", kernel)
    make_tiny_llama(tmp_path)
    plain = LlamaModel.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    packed = LlamaModel.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    n = P.pack_linears_(packed)
    n_modules = sum(isinstance(m, P.PackedLinear) for m in packed.modules())
    assert n == n_modules == (N_LINEARS if branch == "supported" else 0)
    assert (len(calls) > 0) == (branch != "unsupported")
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_forward(plain, ids), _forward(packed, ids))


@pytest.mark.parametrize("supported", [True, False])
def test_bf16_engine_packs_only_where_supported(tmp_path, capability, supported):
    """``SpecEngine`` in bf16 on any CPU: packed target, draft and draft head where oneDNN has the kernel,
    plain modules where not; generation runs either way and both give the same tokens."""
    capability(supported, lambda x, w, b: F.linear(x, w, b))
    make_tiny_llama(tmp_path)
    e = SpecEngine.from_pretrained(str(tmp_path), draft=None, dtype="bfloat16")
    assert e.packed == supported and e.dtype is torch.bfloat16
    n = sum(isinstance(m, P.PackedLinear) for m in [*e.target.modules(), *e.draft.modules()])
    assert (n > 0) == supported
    out = e.generate([[5, 9, 2]], max_new_tokens=6, policy={"policy": "chain", "length": 2})[0]
    assert out.error is None and len(out.token_ids) == 6
    capability(not supported, lambda x, w, b: F.linear(x, w, b))
    other = SpecEngine.from_pretrained(str(tmp_path), draft=None, dtype="bfloat16")
    assert other.packed != supported
    assert other.generate([[5, 9, 2]], max_new_tokens=6, policy={"policy": "chain", "length": 2})[0].token_ids \
        == out.token_ids
