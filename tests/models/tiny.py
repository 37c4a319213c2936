"""A tiny random Llama saved as a real Hugging Face directory (what tests load), and our model's plain causal forward."""

import torch


def make_tiny_llama(path, vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, seed=0, tie=False, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=tie, eos_token_id=None, bos_token_id=None, **extra)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the default init, so greedy paths are decisive
        model.lm_head.weight.mul_(8.0) if not tie else model.model.embed_tokens.weight.mul_(8.0)
    model.save_pretrained(path)
    return model.eval()


def full_forward(model, ids):
    """Logits of our model over ``[bs, T]`` ids with a plain causal mask (no speculation)."""
    from treespec_sglang.engine import KVCache

    bs, T = ids.shape
    cfg = model.config
    cache = KVCache(cfg.num_hidden_layers, bs, cfg.num_key_value_heads, T, cfg.head_dim, torch.float32, "cpu")
    pos = torch.arange(T).expand(bs, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril().expand(bs, T, T)
    return model.lm_head(model(ids, pos, cache.stores(pos, T), mask))
