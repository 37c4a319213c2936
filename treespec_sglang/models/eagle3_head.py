"""EAGLE-3 draft head in the format SGLang 0.5.23 loads as ``LlamaForCausalLMEagle3``.

EAGLE-3 (Li et al. 2025, §3.2 and Fig. 5) replaces EAGLE's top-layer feature with a fusion of a low,
a middle and a high target layer, ``g = fc([l, m, h])``, and trains the head over its own outputs
("training-time test"). One decoder layer, as SGLang's ``llama_eagle3.py`` runs it::

    residual = g                      (fc output, or the head's own previous output down a tree)
    x = cat([input_layernorm(embed(token)), hidden_norm(g)])       # [.., 2 * hidden]
    residual = residual + o_proj(attn(x))                          # q/k/v read 2 * hidden
    out = residual + mlp(post_attention_layernorm(residual))       # the feature passed down the tree
    logits = lm_head(norm(out))                                    # [.., vocab_d] draft vocabulary

The fc runs only when the features are the target's (``3 * target_hidden`` wide). The head owns its LM
head over a reduced vocabulary; ``d2t[i] = target_id(i) - i`` maps draft ids back (SGLang builds
``hot_token_id = d2t + arange``). The embedding is the target's (shared, not saved).

Which target layers: SGLang's default for ``L`` layers captures the residual stream entering layers
``2, L // 2, L - 3`` (``set_eagle3_layers_to_capture``); a config's
``eagle_config.eagle_aux_hidden_state_layer_ids`` lists layer *outputs*, i.e. capture index - 1. We
always write that list, so both readers agree. Checkpoint keys (SpecForge's, SGLang's loader adds the
``model.`` prefix): ``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ``layers.0.hidden_norm.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Tuple

import torch
from torch import nn

from .draft_head import SharedEmbedHead
from .llama import MLP, Attention, LlamaConfig, RMSNorm, rope_cos_sin, rope_inv_freq

__all__ = ["Eagle3DraftHead", "EAGLE3_ARCH", "default_aux_layers"]

EAGLE3_ARCH = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> Tuple[int, int, int]:
    """SGLang's default capture points for an ``L``-layer target: the residual stream *entering*
    layers ``2, L // 2, L - 3``. Example: ``L = 30 -> (2, 15, 27)``."""
    return (2, num_layers // 2, num_layers - 3)


class _Eagle3Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, in_features=2 * H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb, g, cos, sin, store, mask, rows=None):
        # emb, g [bs, q, hidden] (or [1, T, hidden] with rows) -> [same] the pre-norm output
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], dim=-1)
        r = g + self.self_attn(x, cos, sin, store, mask, rows)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3DraftHead(SharedEmbedHead):
    """``forward(tokens, features, positions, store, mask) -> [bs, q, hidden]`` draft features;
    ``logits(features) -> [bs, q, vocab_d]``.

    ``features`` is ``[bs, q, 3 * target_hidden]`` (the target's fused aux states: fc runs) or
    ``[bs, q, hidden]`` (the head's own output at the parent node). ``hot_ids`` ``[vocab_d]`` int64 is
    the target id of each draft id.
    """

    owns_lm_head = True

    def __init__(self, cfg: LlamaConfig, draft_vocab: int, target_hidden: int, aux_layers: Optional[Tuple[int, ...]]):
        super().__init__()
        self.config = cfg
        # capture points (residual stream entering these target layers); None until the target is known
        self.aux_layers = None if aux_layers is None else tuple(int(x) for x in aux_layers)
        self.target_hidden = target_hidden
        H = cfg.hidden_size
        self.fc = nn.Linear((3 if aux_layers is None else len(aux_layers)) * target_hidden, H, bias=False)
        self.layers = nn.ModuleList([_Eagle3Layer(cfg)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)
        self.register_buffer("hot_ids", torch.arange(draft_vocab), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def feature_width(self) -> int:
        """Width of the target features this head reads (``3 * target_hidden``)."""
        return self.fc.in_features

    @property
    def feature_columns(self) -> slice:
        """The columns of the target's states this head reads: ``[final | aux ...]`` -> the aux part."""
        return slice(self.target_hidden, None)

    def forward(self, tokens, features, positions, store, mask, rows=None):
        # tokens [bs, q] int64, features [bs, q, 3 * target_hidden | hidden], positions [bs, q],
        # mask [bs, q, kv]; rows: optional [T] int64 live rows of the flat [bs * q] grid -> [T, hidden]
        tokens, features = self._live(tokens, features, rows)
        g = self.fc(features) if features.shape[-1] != self.config.hidden_size else features
        emb = self.embed(tokens).to(g.dtype)
        cos, sin = rope_cos_sin(self.inv_freq, positions, g.dtype)
        out = self.layers[0](emb, g, cos, sin, store, mask, rows)
        return out[0] if rows is not None else out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` draft features -> ``[..., vocab_d]`` logits over draft ids."""
        return self.lm_head(self.norm(h))

    # ------------------------------------------------------------------ construction / IO
    @classmethod
    def for_target(cls, target_cfg: LlamaConfig, hot_ids: torch.Tensor, lm_head_weight: torch.Tensor = None,
                   norm_weight: torch.Tensor = None, seed: int = 0, dtype=torch.float32) -> "Eagle3DraftHead":
        """A seeded head for ``target_cfg`` over draft vocabulary ``hot_ids`` ([vocab_d] target ids).

        ``lm_head_weight`` ([vocab, hidden]) and ``norm_weight`` ([hidden]), the target's, initialise the
        draft LM head with its rows of ``hot_ids`` and the final norm (logits start on the target's
        scale: what EAGLE-3 training starts from); without them those are random / ones."""
        from .draft_head import head_cfg_dict

        cfg = LlamaConfig.from_dict(head_cfg_dict(target_cfg))
        hot = torch.as_tensor(hot_ids, dtype=torch.int64)
        head = cls(cfg, hot.numel(), target_cfg.hidden_size, default_aux_layers(target_cfg.num_hidden_layers))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5))
            if lm_head_weight is not None:
                head.lm_head.weight.copy_(lm_head_weight.detach().float()[hot])
            if norm_weight is not None:
                head.norm.weight.copy_(norm_weight.detach().float())
        head.hot_ids = hot
        return head.to(dtype).eval()

    def save(self, path: str, dtype=torch.bfloat16) -> None:
        """Write ``config.json`` + ``model.safetensors`` that SGLang serves with
        ``--speculative-algorithm EAGLE3`` (no ``--speculative-token-map``: ``d2t`` is inside)."""
        from safetensors.torch import save_file

        from .draft_head import _cfg_dict, refuse_biases

        refuse_biases(self.config)
        os.makedirs(path, exist_ok=True)
        V = self.config.vocab_size
        cfg = {**_cfg_dict(self.config), "num_hidden_layers": 1, "architectures": [EAGLE3_ARCH],
               "model_type": "llama", "tie_word_embeddings": False, "draft_vocab_size": self.lm_head.out_features,
               "target_hidden_size": self.target_hidden,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [x - 1 for x in self.aux_layers]},
               "torch_dtype": str(dtype).replace("torch.", "")}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        sd = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        hot = self.hot_ids.cpu()
        sd["d2t"] = (hot - torch.arange(hot.numel())).contiguous()  # draft id -> target id - draft id
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[hot] = True
        sd["t2d"] = t2d
        save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def load(cls, path: str, dtype=torch.float32) -> "Eagle3DraftHead":
        raw, sd = cls._read(path, EAGLE3_ARCH)
        d2t = sd.pop("d2t").long()
        sd.pop("t2d", None)
        sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}
        sd = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}  # SpecForge's older name
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        cfg = LlamaConfig.from_dict(raw)
        aux = tuple(x + 1 for x in ids) if ids else None  # None: SGLang's default, set from the target
        head = cls(cfg, int(raw["draft_vocab_size"]), int(raw.get("target_hidden_size", cfg.hidden_size)), aux)
        head.load_state_dict({k: v.to(dtype) for k, v in sd.items()})
        head.hot_ids = d2t + torch.arange(d2t.numel())
        return head.to(dtype).eval()
