"""The EAGLE-3 head and the target's captured layers against transformers' own modules (the oracle never runs
our attention, norm or capture code), and the checkpoint in the exact layout SGLang 0.5.23's
``LlamaForCausalLMEagle3.load_weights`` reads."""

import json

import pytest
import torch

from tests.models.tiny import make_tiny_llama
from treespec_sglang.engine import KVCache
from treespec_sglang.models import Eagle3DraftHead, EagleDraftHead, LlamaModel, draft_arch, load_draft_head
from treespec_sglang.models.eagle3_head import default_aux_layers

pytest.importorskip("transformers")

LAYERS = 8  # default capture points (2, 4, 5): three distinct layers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny8")
    hf = make_tiny_llama(path, layers=LAYERS)
    return hf, LlamaModel.from_pretrained(str(path)), str(path)


def _head(target, seed=0, vocab_d=40):
    hot = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:vocab_d]
    return Eagle3DraftHead.for_target(target.config, hot, target.lm_head.weight, target.model.norm.weight,
                                      seed=seed).attach(target.model.embed_tokens)


def _causal(model, ids, layers=None):
    bs, T = ids.shape
    cfg = model.config
    n_layers = layers or cfg.num_hidden_layers
    cache = KVCache(n_layers, bs, cfg.num_key_value_heads, T, cfg.head_dim, torch.float32, "cpu")
    pos = torch.arange(T).expand(bs, T)
    return pos, cache, torch.ones(T, T, dtype=torch.bool).tril().expand(bs, T, T)


def test_default_capture_points_are_sglangs():
    assert default_aux_layers(30) == (2, 15, 27)  # SmolLM2-135M: layers_to_capture = [2, L // 2, L - 3]
    assert default_aux_layers(8) == (2, 4, 5)


def test_target_returns_final_states_then_the_residual_stream_entering_each_captured_layer(tiny):
    hf, ours, _ = tiny
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    ours.aux_layers = default_aux_layers(LAYERS)
    try:
        pos, cache, mask = _causal(ours, ids)
        with torch.no_grad():
            got = ours(ids, pos, cache.stores(pos, 7), mask)  # [bs, T, 4 * hidden]
            ref = hf(ids, output_hidden_states=True).hidden_states  # [0] embeddings, [i] = input of layer i
    finally:
        ours.aux_layers = ()
    H = 64
    assert got.shape == (2, 7, 4 * H)
    torch.testing.assert_close(got[..., :H], ref[-1], rtol=1e-4, atol=1e-4)  # HF's last entry is final-normed
    for j, layer in enumerate((2, 4, 5)):
        torch.testing.assert_close(got[..., H * (j + 1):H * (j + 2)], ref[layer], rtol=1e-4, atol=1e-4)


def _oracle_layer(head, emb, g, positions):
    """SGLang's ``llama_eagle3.LlamaDecoderLayer.forward`` + final norm, written with transformers' modules."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb
    from transformers import LlamaConfig as HFConfig

    cfg = head.config
    hcfg = HFConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                    num_key_value_heads=cfg.num_key_value_heads, rope_theta=cfg.rope_theta,
                    max_position_embeddings=512, rms_norm_eps=cfg.rms_norm_eps)
    layer = head.layers[0]

    def norm(mod, x):
        n = LlamaRMSNorm(x.shape[-1], eps=cfg.rms_norm_eps)
        n.weight.data.copy_(mod.weight.data)
        return n(x)

    x = torch.cat([norm(layer.input_layernorm, emb), norm(layer.hidden_norm, g)], -1)
    a = layer.self_attn
    bs, T, _ = x.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = (x @ a.q_proj.weight.T).view(bs, T, nh, hd).transpose(1, 2)
    k = (x @ a.k_proj.weight.T).view(bs, T, nkv, hd).transpose(1, 2)
    v = (x @ a.v_proj.weight.T).view(bs, T, nkv, hd).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(hcfg)(x, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    att = (q @ k.transpose(-1, -2)) / hd ** 0.5
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    o = (att @ v).transpose(1, 2).reshape(bs, T, nh * hd) @ a.o_proj.weight.T
    r = g + o
    m = layer.mlp
    h = norm(layer.post_attention_layernorm, r)
    out = r + (torch.nn.functional.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return out, norm(head.norm, out) @ head.lm_head.weight.T


@pytest.mark.parametrize("width", ["target", "own"])
def test_head_forward_and_logits_equal_sglangs_layer_written_with_transformers(tiny, width):
    _, ours, _ = tiny
    head = _head(ours)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (2, 6), generator=gen)
    feats = torch.randn(2, 6, 3 * 64 if width == "target" else 64, generator=gen) * 4
    pos, cache, mask = _causal(head, ids, layers=1)
    with torch.no_grad():
        out = head(ids, feats, pos, cache.stores(pos, 6)[0], mask)
        logits = head.logits(out)
        g = feats @ head.fc.weight.T if width == "target" else feats  # fc only over the target's 3 layers
        ref_out, ref_logits = _oracle_layer(head, ours.model.embed_tokens(ids), g, pos)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_checkpoint_has_sglangs_layout_and_round_trips(tiny, tmp_path):
    _, ours, _ = tiny
    head = _head(ours, vocab_d=40)
    head.save(str(tmp_path), dtype=torch.float32)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 40 and cfg["target_hidden_size"] == 64 and cfg["tie_word_embeddings"] is False
    # SGLang captures layer_id + 1 for each listed id: the listed ids are one below our capture points
    assert [x + 1 for x in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == [2, 4, 5]
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "model.safetensors"))
    assert sd["fc.weight"].shape == (64, 3 * 64) and "fc.bias" not in sd  # SGLang: bias only if config.bias
    assert sd["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * 64  # q/k/v read [embedding | feature]
    assert {"layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight", "norm.weight"} <= set(sd)
    assert sd["lm_head.weight"].shape == (40, 64) and not any("embed" in k for k in sd)
    # SGLang: hot_token_id = d2t + arange(draft vocab); t2d marks the target ids the draft covers
    assert torch.equal(sd["d2t"] + torch.arange(40), head.hot_ids)
    assert sd["t2d"].dtype == torch.bool and int(sd["t2d"].sum()) == 40 and bool(sd["t2d"][head.hot_ids].all())
    assert draft_arch(str(tmp_path)) == "LlamaForCausalLMEagle3"
    back = load_draft_head(str(tmp_path))
    assert isinstance(back, Eagle3DraftHead) and back.aux_layers == (2, 4, 5)
    assert torch.equal(back.hot_ids, head.hot_ids)
    for (k, a), (k2, b) in zip(sorted(head.state_dict().items()), sorted(back.state_dict().items())):
        assert k == k2 and torch.equal(a, b)


def test_loader_reads_specforge_names_and_the_model_prefix(tiny, tmp_path):
    """SpecForge writes ``midlayer.*``; SGLang's loader accepts ``model.``-prefixed keys too."""
    from safetensors.torch import load_file, save_file

    _, ours, _ = tiny
    head = _head(ours)
    head.save(str(tmp_path), dtype=torch.float32)
    sd = load_file(str(tmp_path / "model.safetensors"))
    renamed = {("model." + k.replace("layers.0.", "midlayer.")) if k not in ("d2t", "t2d") else k: v
               for k, v in sd.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    back = load_draft_head(str(tmp_path))
    assert torch.equal(back.layers[0].self_attn.q_proj.weight, head.layers[0].self_attn.q_proj.weight)


def test_an_eagle_checkpoint_still_loads_as_eagle(tiny, tmp_path):
    _, ours, _ = tiny
    EagleDraftHead.for_target(ours.config).save(str(tmp_path))
    assert draft_arch(str(tmp_path)) == "LlamaForCausalLMEagle"
    assert isinstance(load_draft_head(str(tmp_path)), EagleDraftHead)
    cfg = json.load(open(tmp_path / "config.json"))
    cfg["architectures"] = ["LlamaForCausalLM"]
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match="architectures must include"):
        load_draft_head(str(tmp_path))
