"""A tiny random Llama saved as a real Hugging Face directory (what tests load)."""

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
