"""``--target random`` of ``bench/plugin_round_profile.py``: a target of the demo target's shape with random weights and
no tokenizer, and prompts of random ids: what a GPU session can serve before the demo target's files are staged
(round times and outputs only; a trained draft's accept lengths on it mean nothing)."""

from __future__ import annotations

import json
import os
import random

RANDOM_PREFIX = "treespec-random-target-"  # the folder --target random writes its weights to (removed after)


def random_target(out: str, draft: str, layers: int = 30, seed: int = 0) -> str:
    """A Llama target of the draft head's dimensions (the demo target's: ``layers`` 30) with random weights and no
    tokenizer, written to ``out``: what a GPU session can serve without the demo target's files. Its rounds cost
    what the demo target's do; its accept lengths (a trained draft on a random target) mean nothing."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with open(os.path.join(draft, "config.json")) as f:
        head = json.load(f)
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "hidden_act", "bos_token_id",
            "eos_token_id", "pad_token_id")
    cfg = LlamaConfig(**{k: head[k] for k in keep if k in head}, num_hidden_layers=layers, tie_word_embeddings=True,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    return out


def random_prompt_ids(n: int, vocab: int, seed: int = 0) -> list:
    """``n`` prompts of 32-192 random token ids (never the first 3: BOS / EOS / padding), for a random target."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 192))] for _ in range(n)]
