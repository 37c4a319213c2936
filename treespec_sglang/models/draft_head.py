"""EAGLE draft head in the format SGLang 0.5.23 loads as ``LlamaForCausalLMEagle``.

One decoder layer whose first norm is skipped, fed ``fc([embed(token), feature])`` where
``feature`` is the target's final hidden state at the previous position (or the draft's own
output further down a tree); output = the layer's residual stream, no final norm, projected by
the *target's* LM head (EAGLE shares embedding and head). Checkpoint keys carry no ``model.``
prefix (SGLang's loader adds it): ``fc.weight``, ``fc.bias``, ``layers.0.self_attn.q_proj.weight``,
``layers.0.mlp.gate_proj.weight``, ``layers.0.post_attention_layernorm.weight``, ...
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch
from torch import nn

from ..tree.ragged import from_grid
from .llama import DecoderLayer, LlamaConfig, rope_cos_sin, rope_inv_freq

__all__ = ["EagleDraftHead", "DRAFT_ARCH"]

DRAFT_ARCH = "LlamaForCausalLMEagle"


class SharedEmbedHead(nn.Module):
    """What every draft head shares: the target's token embedding (attached, not saved) and the live rows
    of a ragged draft step."""

    embed: nn.Embedding = None  # set by attach()

    def attach(self, embed: nn.Embedding):
        object.__setattr__(self, "embed", embed)  # shared with the target, kept out of state_dict
        return self

    @staticmethod
    def files(path: str):
        """``(config.json, model.safetensors)`` paths of the draft directory ``path``; raises
        ``FileNotFoundError`` naming the missing one (cheap: callers check before loading a target)."""
        cfg_path, w_path = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
        for p in (cfg_path, w_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"draft head: {p} is missing (an EAGLE draft directory needs config.json "
                                        f"and model.safetensors; write one with EagleDraftHead.save)")
        return cfg_path, w_path

    @classmethod
    def _read(cls, path: str, arch: str):
        """``(config dict, state dict)`` of the draft directory ``path`` after checking it names ``arch``."""
        from safetensors.torch import load_file

        cfg_path, w_path = cls.files(path)
        with open(cfg_path) as f:
            raw = json.load(f)
        if arch not in (raw.get("architectures") or []):
            raise ValueError(f"draft head: {cfg_path} architectures must include {arch!r}, "
                             f"got {raw.get('architectures')}")
        return raw, load_file(w_path)

    @staticmethod
    def _live(tokens, features, rows):
        # tokens [bs, q], features [bs, q, f], rows [T] (or None) -> the T live ones as [1, T] / [1, T, f]
        if rows is None:
            return tokens, features
        return from_grid(tokens, rows)[None], from_grid(features, rows)[None]


class EagleDraftHead(SharedEmbedHead):
    """``forward(tokens, features, positions, store, mask) -> [bs, q, hidden]`` draft features.

    ``embed`` is the target's token embedding (shared, not saved).
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(cfg, input_norm=False)])
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    owns_lm_head = False  # drafts through the target's LM head (EAGLE-3 heads own theirs)

    @property
    def feature_columns(self) -> slice:
        """The columns of the target's states this head reads: the final-norm states ``[:hidden]``."""
        return slice(0, self.config.hidden_size)

    def forward(self, tokens, features, positions, store, mask, rows=None):
        # tokens [bs, q] int64, features [bs, q, hidden], positions [bs, q], mask [bs, q, kv]
        # rows: optional [T] int64, the live tokens' rows in the flattened [bs * q] grid (ragged: fc and
        # the layer's linears run on those T only; attention on the grid) -> [T, hidden] in rows order
        tokens, features = self._live(tokens, features, rows)
        x = self.fc(torch.cat([self.embed(tokens).to(features.dtype), features], dim=-1))
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        out = self.layers[0](x, cos, sin, store, mask, rows)
        return out[0] if rows is not None else out

    # ------------------------------------------------------------------ construction / IO
    @classmethod
    def for_target(cls, target_cfg: LlamaConfig, seed: int = 0, dtype=torch.float32) -> "EagleDraftHead":
        """A seeded random head shaped for ``target_cfg`` (tests and the untrained demo)."""
        cfg = LlamaConfig.from_dict(head_cfg_dict(target_cfg))
        g = torch.Generator().manual_seed(seed)
        head = cls(cfg)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.endswith("layernorm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5))
        return head.to(dtype).eval()

    def save(self, path: str, dtype=torch.bfloat16) -> None:
        """Write ``config.json`` + ``model.safetensors`` loadable by SGLang as an EAGLE draft."""
        from safetensors.torch import save_file

        refuse_biases(self.config)
        os.makedirs(path, exist_ok=True)
        # tie_word_embeddings is always False: the head shares the *target's* embedding and LM head
        # (SGLang's set_embed_and_head); a true value makes SGLang's llama.py tie the draft's missing
        # embedding at load time and fail ("'VocabParallelEmbedding' object has no attribute 'weight'").
        cfg = {**_cfg_dict(self.config), "num_hidden_layers": 1, "architectures": [DRAFT_ARCH],
               "model_type": "llama", "tie_word_embeddings": False,
               "torch_dtype": str(dtype).replace("torch.", "")}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        sd = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def load(cls, path: str, dtype=torch.float32) -> "EagleDraftHead":
        raw, sd = cls._read(path, DRAFT_ARCH)
        head = cls(LlamaConfig.from_dict(raw))
        head.load_state_dict({k: v.to(dtype) for k, v in sd.items()})
        return head.to(dtype).eval()


def head_cfg_dict(target_cfg: LlamaConfig) -> dict:
    """A draft head's config for ``target_cfg``: one layer and no biases whatever the target's. SGLang's EAGLE and
    EAGLE-3 draft layers have none where ours would (EAGLE-3's ``qkv_proj``, every ``LlamaMLP``, a Qwen2 target's
    ``o_proj`` left out of its attention bias), and its loaders skip a weight they do not know without a word."""
    return {**_cfg_dict(target_cfg), "num_hidden_layers": 1, "attention_bias": False, "mlp_bias": False}


def refuse_biases(cfg: LlamaConfig) -> None:
    """``save``'s check: a head with biases (an old checkpoint) would load into SGLang with them dropped."""
    if cfg.attention_bias or cfg.mlp_bias:
        raise ValueError(f"this draft head has biases (attention_bias={cfg.attention_bias}, mlp_bias="
                         f"{cfg.mlp_bias}); SGLang's EAGLE / EAGLE-3 draft layers would load it without them: train "
                         f"a head without biases (for_target builds one)")


def _cfg_dict(cfg: LlamaConfig) -> dict:
    d = asdict(cfg)
    extra = d.pop("extra")
    keep = {k: v for k, v in extra.items() if k in ("model_type", "hidden_act", "pad_token_id")}
    return {**keep, **d}
