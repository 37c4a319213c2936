"""Our Llama forward (explicit positions / KV slots / masks) against transformers' LlamaForCausalLM."""

import os

import pytest
import torch

from tests.models.tiny import full_forward, make_tiny_llama
from treespec_sglang.engine import KVCache
from treespec_sglang.models import EagleDraftHead, LlamaModel

pytest.importorskip("transformers")


@pytest.mark.parametrize("tie,extra", [(False, {}), (True, {}), (False, {"attention_bias": True}),
                                       (False, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 64}})])
def test_logits_match_transformers(tmp_path, tie, extra):
    hf = make_tiny_llama(tmp_path, tie=tie, **extra)
    ours = LlamaModel.from_pretrained(str(tmp_path))
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        got = full_forward(ours, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tie,extra", [(False, {}), (True, {"attention_bias": True, "mlp_bias": True})])
def test_fused_projections_match_transformers(tmp_path, tie, extra):
    """fuse_() (one q/k/v and one gate/up matmul per layer) computes the same logits, biases included."""
    hf = make_tiny_llama(tmp_path, tie=tie, **extra)
    with torch.no_grad():  # HF initialises biases to zero: make them count
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    hf.save_pretrained(tmp_path)
    plain = LlamaModel.from_pretrained(str(tmp_path))
    ours = LlamaModel.from_pretrained(str(tmp_path)).fuse_()
    assert all(layer.self_attn.qkv_proj is not None and not hasattr(layer.self_attn, "q_proj")
               for layer in ours.model.layers)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(full_forward(plain, ids), ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(full_forward(ours, ids), ref, rtol=1e-4, atol=1e-4)


def test_kv_compact_reads_before_writing():
    """Overlapping source / destination slots (accepted path [0, 1, 3] -> slots 10, 11, 12): every
    destination gets the *old* content of its source, in every layer / head."""
    c = KVCache(2, 2, 3, 16, 4, torch.bfloat16, "cpu")
    c.k.copy_(torch.arange(16, dtype=torch.bfloat16)[None, None, None, :, None].expand_as(c.k))
    c.v.copy_(-c.k)
    src = torch.tensor([[10, 11, 13], [12, 13, 14]])
    dst = torch.tensor([[10, 11, 12], [11, 12, 13]])
    c.compact(src, dst)
    for b in range(2):
        for j in range(3):
            assert (c.k[:, b, :, dst[b, j]] == src[b, j]).all() and (c.v[:, b, :, dst[b, j]] == -src[b, j]).all()
    assert (c.k[:, 0, :, 13] == 13).all() and (c.k[:, 1, :, 10] == 10).all()  # untouched slots stay


def test_incremental_decode_equals_full_forward(tmp_path):
    make_tiny_llama(tmp_path)
    m = LlamaModel.from_pretrained(str(tmp_path))
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    cfg = m.config
    with torch.no_grad():
        ref = full_forward(m, ids)
        cache = KVCache(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 16, cfg.head_dim, torch.float32, "cpu")
        outs = []
        for t in range(9):
            pos = torch.full((2, 1), t)
            mask = (torch.arange(t + 1) <= t)[None, None].expand(2, 1, t + 1)
            outs.append(m.lm_head(m(ids[:, t:t + 1], pos, cache.stores(pos, t + 1), mask)))
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-4, atol=1e-4)


def test_missing_weights_are_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LlamaModel.from_pretrained(str(tmp_path))
    make_tiny_llama(tmp_path / "m")
    weights = next(f for f in os.listdir(tmp_path / "m") if f.endswith(".safetensors"))
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "m" / weights))
    os.remove(tmp_path / "m" / weights)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors or pytorch_model\\*.bin weights found"):
        LlamaModel.from_pretrained(str(tmp_path / "m"))
    gone = "model.layers.0.mlp.down_proj.weight"
    save_file({k: v for k, v in sd.items() if k != gone}, str(tmp_path / "m" / weights))
    with pytest.raises(ValueError, match=f"weights missing from the checkpoint: \\['{gone}'\\]"):
        LlamaModel.from_pretrained(str(tmp_path / "m"))


@pytest.mark.parametrize("tie", [True, False])
def test_draft_head_roundtrip_in_sglang_format(tmp_path, tie):
    make_tiny_llama(tmp_path / "t", tie=tie)
    target = LlamaModel.from_pretrained(str(tmp_path / "t"))
    head = EagleDraftHead.for_target(target.config, seed=3)
    head.save(str(tmp_path / "d"), dtype=torch.float32)
    import json
    from safetensors.torch import load_file

    cfg = json.load(open(tmp_path / "d" / "config.json"))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    # SGLang's llama.py would tie the head's (absent) embedding and fail to load it; tests/e2e load our
    # checkpoints in SGLang's EAGLE class
    assert cfg["tie_word_embeddings"] is False
    keys = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= keys
    assert not any(k.startswith("model.") or "input_layernorm" in k or "embed" in k for k in keys)
    back = EagleDraftHead.load(str(tmp_path / "d"))
    want, got = head.state_dict(), back.state_dict()
    assert list(got) == list(want)  # same names, same order: nothing renamed, dropped or added
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=k)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        EagleDraftHead.load(str(tmp_path / "t2"))


def test_shipped_draft_does_not_tie_embeddings():
    import json
    import os

    import treespec_sglang

    path = os.path.join(os.path.dirname(treespec_sglang.__file__), "assets", "smollm2-135m-eagle", "config.json")
    assert json.load(open(path))["tie_word_embeddings"] is False


@pytest.mark.parametrize("fuse", [False, True])
def test_ragged_rows_equal_the_padded_forward(tmp_path, fuse):
    """The ragged verify (linear layers on the real tokens only, attention on the padded grid) gives the
    padded forward's hidden states on every real token (the oracle); padding rows are simply absent."""
    make_tiny_llama(tmp_path)
    m = LlamaModel.from_pretrained(str(tmp_path))
    if fuse:
        m.fuse_()
    cfg, bs, q, prefix = m.config, 3, 4, 5
    sizes = [4, 1, 2]  # real tokens per request: rows [0..3], [4], [8, 9]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (bs, prefix + q), generator=g)
    pos = torch.arange(prefix + q)[None].expand(bs, -1)
    real = torch.arange(q)[None, :] < torch.tensor(sizes)[:, None]  # [bs, q]
    # each request's tokens form a chain after its prefix; a padding row attends to the prefix only
    causal = torch.ones(q, prefix + q, dtype=torch.bool).tril(prefix)[None] & torch.cat(
        [torch.ones(bs, q, prefix, dtype=torch.bool), real[:, None, :].expand(bs, q, q)], 2)
    rows = torch.tensor([0, 1, 2, 3, 4, 8, 9])
    outs = []
    with torch.no_grad():
        for ragged in (False, True):
            c = KVCache(cfg.num_hidden_layers, bs, cfg.num_key_value_heads, 16, cfg.head_dim, torch.float32, "cpu")
            p0 = pos[:, :prefix]
            m(ids[:, :prefix], p0, c.stores(p0, prefix), torch.ones(bs, prefix, prefix, dtype=torch.bool).tril())
            p1 = pos[:, prefix:]
            outs.append(m(ids[:, prefix:], p1, c.stores(p1, prefix + q), causal, rows=rows if ragged else None))
    padded, flat = outs
    assert flat.shape == (len(rows), cfg.hidden_size)
    torch.testing.assert_close(flat, padded.reshape(bs * q, -1)[rows], rtol=1e-5, atol=1e-5)
