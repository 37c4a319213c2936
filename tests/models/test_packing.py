"""oneDNN weight prepacking (bf16 and float32): each capability check agrees with the kernel on this CPU,
both branches of each check (pack where supported, plain ``nn.Linear`` where not) run on every CPU, and a
packed model gives what the plain one gives (bf16: bit for bit; float32: batch-invariant, within rounding)."""

import pytest
import torch
import torch.nn.functional as F

import treespec_sglang.models.packing as P
from tests.models.tiny import make_tiny_llama
from treespec_sglang.engine import KVCache, SpecEngine
from treespec_sglang.models import LlamaModel

pytest.importorskip("transformers")

N_LINEARS = 2 * 7 + 1  # tiny llama: 2 layers x (q, k, v, o, gate, up, down) + the LM head
DTYPES = [torch.bfloat16, torch.float32]
CHECKS = {torch.bfloat16: "onednn_bf16_supported", torch.float32: "onednn_fp32_supported"}


def _forward(model, ids, dtype):  # ids: [bs, T] -> logits [bs, T, vocab]
    cfg, (bs, T) = model.config, ids.shape
    cache = KVCache(cfg.num_hidden_layers, bs, cfg.num_key_value_heads, T, cfg.head_dim, dtype, "cpu")
    pos = torch.arange(T).expand(bs, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril().expand(bs, T, T)
    with torch.inference_mode():
        return model.lm_head(model(ids, pos, cache.stores(pos, T), mask))


def _rows_alone(fn, x):  # x: [M, in] -> [M, out], each row computed by itself (a plain loop)
    return torch.stack([fn(x[r:r + 1])[0] for r in range(x.shape[0])])


@pytest.fixture
def capability(monkeypatch):
    """Force the capability check of ``dtype`` to an answer; with ``kernel`` also swap the two oneDNN ops
    for a plain-torch stand-in (the reorder keeps the plain layout), so the "supported" branch runs on a
    CPU that lacks the real kernel."""
    def force(dtype, supported, kernel=None):
        monkeypatch.setattr(P, CHECKS[dtype], lambda: (supported, "" if supported else "forced off"))
        if kernel is not None:
            monkeypatch.setattr(P, "_reorder", lambda w, hint: w.clone())
            monkeypatch.setattr(P, "_packed_linear", kernel)
    return force


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_check_agrees_with_the_kernel_on_this_cpu(dtype):
    """Whatever this CPU is: where the check says yes, the real packed op equals ``nn.Linear`` bit for bit
    (bf16; but for one-ulp flips of at most 0.1% of the outputs, seen on AMX at M=1 for this small layer),
    or (float32) gives each row bit for bit what that row gives alone and stays within 1e-5 of a
    float64 product; where it says no, the raw oneDNN op really refuses (or differs), so the "no" is not a
    guess."""
    ok, why = getattr(P, CHECKS[dtype])()
    assert P.packing_available(dtype, "cpu") == ok
    assert not P.packing_available(torch.float16, "cpu") and not P.packing_available(dtype, "meta")
    for bias in (False, True):
        lin = torch.nn.Linear(48, 80, bias=bias).to(dtype)
        if ok:
            p = P.PackedLinear(lin)
            with torch.inference_mode():
                for shape in [(1, 48), (3, 1, 48), (2, 17, 48), (130, 48)]:
                    x = torch.randn(shape).to(dtype)
                    if dtype == torch.bfloat16:  # bit for bit but for rare one-ulp flips near zero
                        got, want = p(x).float(), lin(x).float()
                        ulp = torch.maximum(got.abs(), want.abs()) * 2.0 ** -7  # a bf16 ulp is <= 2^-7 |y|
                        assert ((got - want).abs() <= ulp).all() and (got != want).float().mean() <= 1e-3, shape
                        continue
                    x2 = x.reshape(-1, 48)
                    assert torch.equal(_rows_alone(p, x2), p(x2)), shape
                    want = x2.double() @ lin.weight.double().T + (lin.bias.double() if bias else 0)
                    assert (p(x2).double() - want).abs().max() < 1e-5, shape
        else:
            assert why
            try:
                w = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 16)
                x = torch.randn(17, 48).to(dtype)
                fn = lambda v: torch.ops.mkldnn._linear_pointwise(v, w, lin.bias, "none", [], "")  # noqa: E731
                with torch.inference_mode():
                    y = fn(x)
                    assert not (torch.equal(y, lin(x)) if dtype == torch.bfloat16 else
                                torch.equal(_rows_alone(fn, x), y) and torch.allclose(y, lin(x), atol=1e-5))
            except (RuntimeError, AttributeError):
                pass  # the kernel refuses this CPU, as the check said


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_probe_refuses_wrong_and_batch_variant_kernels(dtype):
    """The probe is not vacuous: a kernel off by 1% fails it in both dtypes, and in float32 so does one
    whose row depends on its neighbours by a single ulp (what batch-variant GEMMs do)."""
    w = torch.randn(24, 16).to(dtype)
    assert P.agrees(lambda x: F.linear(x, w), w) == (True, "") or dtype == torch.float32
    assert not P.agrees(lambda x: F.linear(x, w) * 1.01, w)[0]
    if dtype == torch.float32:
        def variant(x):  # row r gets a 1-ulp nudge only when it has neighbours
            y = F.linear(x, w)
            return torch.nextafter(y, torch.full_like(y, float("inf"))) if x.shape[0] > 1 else y
        ok, why = P.agrees(variant, w)
        assert not ok and "not batch-invariant" in why


def _row_by_row(x, w, b):  # a batch-invariant stand-in kernel: x [..., in] -> [..., out], one row at a time
    rows = x.reshape(-1, x.shape[-1])
    y = torch.cat([F.linear(rows[r:r + 1], w, b) for r in range(rows.shape[0])])
    return y.reshape(*x.shape[:-1], w.shape[0])


def _stand_in(x, w, b):  # what passes the probe on any CPU: x [..., in] -> [..., out]
    """bf16: ``F.linear`` itself, since the bf16 check asks for bit identity with ``nn.Linear``, and bf16
    ``nn.Linear`` is not batch-invariant where oneDNN runs it on AMX (M=1 and M=8 take different kernels), so
    a row-by-row kernel would be refused there. float32: row by row (batch-invariant, what the check asks)."""
    return F.linear(x, w, b) if x.dtype == torch.bfloat16 else _row_by_row(x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("branch", ["supported", "unsupported", "kernel differs"])
def test_pack_linears_follows_the_check(tmp_path, capability, branch, dtype):
    """Supported: every linear is packed and the model gives the plain one's logits (bf16 bit for bit,
    float32 within rounding). Unsupported: nothing is packed (plain ``nn.Linear``, no oneDNN call at all).
    A kernel that differs from ``nn.Linear`` on the probe is refused linear by linear."""
    calls = []

    def kernel(x, w, b):
        calls.append(1)
        y = _stand_in(x, w, b)
        return y * 1.01 if branch == "kernel differs" else y

    capability(dtype, branch != "unsupported", kernel)
    make_tiny_llama(tmp_path)
    plain = LlamaModel.from_pretrained(str(tmp_path), dtype=dtype)
    packed = LlamaModel.from_pretrained(str(tmp_path), dtype=dtype)
    n = P.pack_linears_(packed)
    n_modules = sum(isinstance(m, P.PackedLinear) for m in packed.modules())
    assert n == n_modules == (N_LINEARS if branch == "supported" else 0)
    assert (len(calls) > 0) == (branch != "unsupported")
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    got, want = _forward(packed, ids, dtype), _forward(plain, ids, dtype)
    assert torch.equal(got, want) if dtype == torch.bfloat16 or branch != "supported" else \
        torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_packed_linear_follows_its_weight(capability):
    """In-place edits of the plain weight (``copy_``, ``load_state_dict``) and a new weight tensor reach the
    packed copy on the next call: an engine whose weights change after packing never runs stale ones. The
    real kernel where this CPU has it, else the stand-in (whose "packed" weight is a copy, just as stale)."""
    if not P.packing_available(torch.float32, "cpu"):
        capability(torch.float32, True, _row_by_row)
    lin = torch.nn.Linear(40, 48)
    p = P.PackedLinear(lin)
    x = torch.randn(5, 40)

    def close():  # against a float64 product of the current plain weight
        want = x.double() @ lin.weight.double().T + lin.bias.double()
        return torch.allclose(p(x).double(), want, atol=1e-5)

    with torch.inference_mode():
        assert close()
    with torch.no_grad():
        lin.weight.mul_(-3)
    with torch.inference_mode():
        assert close()
    lin.load_state_dict({"weight": torch.randn(48, 40), "bias": torch.randn(48)})
    with torch.inference_mode():
        assert close()
    p.weight = lin.weight = torch.nn.Parameter(torch.randn(48, 40))
    with torch.inference_mode():
        assert close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("supported", [True, False])
def test_engine_packs_only_where_supported(tmp_path, capability, supported, dtype):
    """``SpecEngine`` on any CPU: packed target, draft and draft head where the check passes, plain modules
    where not; ``pack_note`` says which; generation runs either way and both give the same tokens."""
    capability(dtype, supported, _stand_in)
    make_tiny_llama(tmp_path)
    e = SpecEngine.from_pretrained(str(tmp_path), draft=None, dtype=dtype)
    assert e.packed == supported and e.dtype is dtype
    assert e.pack_note.startswith("oneDNN-prepacked" if supported else "plain nn.Linear (forced off)")
    n = sum(isinstance(m, P.PackedLinear) for m in [*e.target.modules(), *e.draft.modules()])
    assert (n > 0) == supported
    out = e.generate([[5, 9, 2]], max_new_tokens=6, policy={"policy": "chain", "length": 2})[0]
    assert out.error is None and len(out.token_ids) == 6
    capability(dtype, not supported, _stand_in)
    other = SpecEngine.from_pretrained(str(tmp_path), draft=None, dtype=dtype)
    assert other.packed != supported
    assert other.generate([[5, 9, 2]], max_new_tokens=6, policy={"policy": "chain", "length": 2})[0].token_ids \
        == out.token_ids


def test_pack_option_is_explicit(tmp_path, capability):
    """``pack=False`` never packs, ``pack=True`` packs or raises with the probe's reason (no silent plain
    fallback), and anything but None / True / False is refused by name."""
    make_tiny_llama(tmp_path)
    capability(torch.float32, True, _row_by_row)
    assert SpecEngine.from_pretrained(str(tmp_path), draft=None, dtype="float32", pack=True).packed
    off = SpecEngine.from_pretrained(str(tmp_path), draft=None, dtype="float32", pack=False)
    assert not off.packed and off.pack_note == "plain nn.Linear (pack=False)"
    assert not any(isinstance(m, P.PackedLinear) for m in off.target.modules())
    with pytest.raises(ValueError, match="pack=True needs fuse=True"):
        SpecEngine.from_pretrained(str(tmp_path), draft=None, dtype="float32", pack=True, fuse=False)
    with pytest.raises(ValueError, match="pack must be None"):
        SpecEngine.from_pretrained(str(tmp_path), draft=None, dtype="float32", pack="yes")
    capability(torch.float32, False)
    with pytest.raises(ValueError, match="pack=True: forced off"):
        SpecEngine.from_pretrained(str(tmp_path), draft=None, dtype="float32", pack=True)
    with pytest.raises(ValueError, match="pack=True: prepacking is for bf16 / float32 on a CPU"):
        P.resolve_pack(True, torch.float16, "cpu")


def test_a_packed_linear_trains_like_nn_linear(capability):
    """With grad mode on and a weight that requires grad, the gradient is ``nn.Linear``'s (the packed op has
    none): a draft head fine-tuned inside a packed engine learns."""
    if not P.packing_available(torch.float32, "cpu"):
        capability(torch.float32, True, _row_by_row)
    lin = torch.nn.Linear(16, 8)
    p = P.PackedLinear(lin)
    x = torch.randn(4, 16)
    p(x).square().sum().backward()
    g = lin.weight.grad.clone()
    lin.weight.grad = None
    F.linear(x, lin.weight, lin.bias).square().sum().backward()
    assert g.abs().sum() > 0 and torch.allclose(g, lin.weight.grad, atol=1e-5)


def test_a_packed_linear_copies_moves_and_saves_like_nn_linear(capability):
    """``copy.deepcopy`` (which an opaque oneDNN tensor refuses), ``.to(dtype)`` and ``state_dict`` see the
    plain weight only; the copy packs again on first use and gives the original's output."""
    import copy

    if not P.packing_available(torch.float32, "cpu"):
        capability(torch.float32, True, _row_by_row)
    lin = torch.nn.Linear(16, 8)
    p = P.PackedLinear(lin)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        want = p(x)
        q = copy.deepcopy(p)
        assert torch.equal(q(x), want) and q.weight is not p.weight
    assert list(p.state_dict()) == ["weight", "bias"]
    p.to(torch.float64)
    with torch.inference_mode():
        y = p(x.double())
    assert y.dtype == torch.float64 and torch.allclose(y, x.double() @ lin.weight.double().T + lin.bias.double())
