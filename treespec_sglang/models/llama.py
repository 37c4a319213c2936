"""A small Llama-family model (gpt-fast style) that runs tree verification with a KV cache.

It loads any Hugging Face ``LlamaForCausalLM`` directory (Llama, SmolLM2, Mistral-style; Qwen2
biases via ``attention_bias``) from safetensors and is checked against ``transformers`` in
``tests/models``. Unlike the HF module it takes explicit per-token positions, KV write slots and
a boolean attention mask, which is what tree attention over a per-request cache needs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..tree.ragged import from_grid, to_grid

__all__ = ["LlamaConfig", "LlamaModel", "RMSNorm", "DecoderLayer", "rope_cos_sin", "load_state_dict"]

StoreFn = Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a HF Llama ``config.json`` this implementation uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: Optional[int] = None
    eos_token_id: object = None  # int or list of ints
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"config.{name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("config.num_attention_heads must be a multiple of num_key_value_heads")
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type"))
        if kind not in (None, "default", "linear", "llama3"):
            raise ValueError(f"config.rope_scaling type must be one of default/linear/llama3, got {kind!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        d = dict(d)
        if "head_dim" not in d or d["head_dim"] is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d.setdefault("num_key_value_heads", d["num_attention_heads"])
        rp = d.get("rope_parameters") or {}
        if "rope_theta" not in d and "rope_theta" in rp:  # transformers >= 5 nests RoPE settings
            d["rope_theta"] = rp["rope_theta"]
        if d.get("rope_scaling") is None and rp.get("rope_type") not in (None, "default"):
            d["rope_scaling"] = rp
        names = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: d[k] for k in names if k in d}, extra={k: v for k, v in d.items() if k not in names})

    @classmethod
    def from_dir(cls, path: str) -> "LlamaConfig":
        cfg = os.path.join(path, "config.json")
        if not os.path.isfile(cfg):
            raise FileNotFoundError(f"{cfg} not found: a Hugging Face model directory needs config.json")
        with open(cfg) as f:
            return cls.from_dict(json.load(f))

    @property
    def eos_ids(self) -> list:
        e = self.eos_token_id
        return [] if e is None else [e] if isinstance(e, int) else list(e)


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "llama3":  # Llama 3.1 frequency-dependent scaling
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[bs, q]`` positions -> cos, sin ``[bs, 1, q, head_dim]``."""
    freqs = positions.float()[..., None] * inv_freq  # [bs, q, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, in_features: Optional[int] = None):
        # in_features: q/k/v input width (EAGLE-3's draft layer reads [embedding | feature], 2 * hidden)
        super().__init__()
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        I = in_features or H
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(I, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(I, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(I, nkv * hd, bias=cfg.attention_bias)
        # Llama's attention_bias covers o_proj too; Qwen2 biases q/k/v only
        self.o_proj = nn.Linear(nh * hd, H, bias=cfg.attention_bias and cfg.extra.get("model_type") != "qwen2")
        self.qkv_proj: Optional[nn.Linear] = None  # set by fuse_()

    def fuse_(self) -> None:
        """Replace q/k/v_proj by one ``[hidden -> (nh + 2 nkv) * head_dim]`` linear (inference only:
        one matmul instead of three per layer; the separate weights are dropped)."""
        self.qkv_proj = _fused_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, store: StoreFn, mask, rows: Optional[torch.Tensor] = None):
        """Self-attention with explicit keys: ``store(k, v)`` writes this step's keys and returns all of them.

        x ``[bs, q, hidden]`` (or ``[1, T, hidden]``: the ``T`` real tokens of a ragged batch, ``rows`` ``[T]``
        int64 their rows in the ``[bs * q]`` grid, :mod:`treespec_sglang.tree.ragged`); cos / sin
        ``[bs, 1, q, head_dim]``; mask ``[bs, q, kv]`` bool (True = attend) -> ``[bs, q, hidden]`` (ragged:
        ``[1, T, hidden]``). Ragged: the projections run on the ``T`` tokens only, the attention on the padded
        grid (padding rows: zero q/k/v, masked out by the caller's mask, never read back). Example: bs 2, q 3,
        request 0 has 3 tokens and request 1 has 1: rows = [0, 1, 2, 3]; grid rows 4 and 5 are padding.
        """
        flat = x[0] if rows is not None else x
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(flat)
        else:
            qkv = torch.cat([self.q_proj(flat), self.k_proj(flat), self.v_proj(flat)], dim=-1)
        bs, q = mask.shape[0], mask.shape[1]
        if rows is not None:
            qkv = to_grid(qkv, rows, bs, q)  # [bs, q, (nh + 2 nkv) * head_dim]
        o = self._attend(qkv, cos, sin, store, mask)  # [bs, q, nh * head_dim]
        if rows is not None:
            return self.o_proj(from_grid(o, rows))[None]
        return self.o_proj(o)

    def _attend(self, qkv, cos, sin, store: StoreFn, mask):
        # qkv [bs, q, (nh + 2 nkv) * head_dim] -> [bs, q, nh * head_dim]: RoPE on the q and k heads, then SDPA
        bs, q = qkv.shape[0], qkv.shape[1]
        nh, nkv, hd = self.nh, self.nkv, self.hd
        qkv = qkv.view(bs, q, nh + 2 * nkv, hd).transpose(1, 2)  # [bs, heads, q, head_dim]
        qk = qkv[:, :nh + nkv]
        qk = qk * cos + _rotate_half(qk) * sin
        qh, kh, vh = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]
        K, V = store(kh, vh)  # [bs, kv_heads, kv, head_dim], this step's keys included
        o = F.scaled_dot_product_attention(qh, K, V, attn_mask=mask[:, None], enable_gqa=nh != nkv)
        return o.transpose(1, 2).reshape(bs, q, nh * hd)


def _fused_linear(parts) -> nn.Linear:
    """One linear whose output is the concatenation of ``parts``' outputs (same input)."""
    w = torch.cat([p.weight.detach() for p in parts], 0)
    bias = all(p.bias is not None for p in parts)
    out = nn.Linear(w.shape[1], w.shape[0], bias=bias, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w, requires_grad=False)
    if bias:
        out.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts], 0), requires_grad=False)
    return out


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(H, I, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(I, H, bias=cfg.mlp_bias)
        self.gate_up_proj: Optional[nn.Linear] = None  # set by fuse_()

    def fuse_(self) -> None:
        """Replace gate/up_proj by one ``[hidden -> 2 * intermediate]`` linear (inference only)."""
        self.gate_up_proj = _fused_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama block. ``input_norm=False`` is EAGLE's first draft layer (no input_layernorm)."""

    def __init__(self, cfg: LlamaConfig, input_norm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, store: StoreFn, mask, rows: Optional[torch.Tensor] = None):
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        x = x + self.self_attn(h, cos, sin, store, mask, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """``LlamaForCausalLM`` weights (same parameter names), explicit positions / cache / mask."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # EAGLE-3: capture the residual stream entering these layers (set by the engine for an EAGLE-3 draft)
        self.aux_layers: Tuple[int, ...] = ()

    def fuse_(self) -> "LlamaModel":
        """Fuse each layer's q/k/v and gate/up projections for inference (fewer, larger matmuls: on a
        CPU the per-op overhead dominates a one-token step of a small model). The unfused parameter
        names are gone afterwards, so fuse after loading and never before saving or training."""
        for layer in self.model.layers:
            layer.self_attn.fuse_()
            layer.mlp.fuse_()
        return self

    def forward(self, input_ids, positions, stores, mask, rows: Optional[torch.Tensor] = None):
        """Run the decoder.

        Parameters
        ----------
        input_ids : ``[bs, q]`` int64; positions : ``[bs, q]`` int64
        stores : one ``store(k, v) -> (K, V)`` per layer (writes this step's keys, returns all keys)
        mask : ``[bs, q, kv]`` bool
        rows : optional ``[T]`` int64, the real tokens' rows in the flattened ``[bs * q]`` grid (ragged
            verify: the linear layers run on these ``T`` tokens only, the attention on the padded grid;
            padding rows write keys to the cache but attend / are attended by nothing the caller keeps)

        Returns
        -------
        ``[bs, q, hidden]`` final-norm hidden states (what EAGLE drafts consume); with ``rows``,
        ``[T, hidden]``: the real tokens' states in ``rows`` order. With ``aux_layers`` set (EAGLE-3),
        ``[.., hidden * (1 + len(aux_layers))]``: the final-norm states followed by the residual stream
        entering each of those layers (SGLang's capture points), e.g. ``[final | l2 | l15 | l27]``.

        Example: ``rows = [0, 1, 3]`` of a ``[2, 2]`` grid runs 3 tokens: (0, 0), (0, 1), (1, 1).
        """
        if rows is not None:
            x = self.model.embed_tokens(input_ids.reshape(-1).index_select(0, rows))[None]  # [1, T, hidden]
        else:
            x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        aux = {}  # layer -> the residual stream entering it
        for i, (layer, store) in enumerate(zip(self.model.layers, stores)):
            if i in self.aux_layers:
                aux[i] = x
            x = layer(x, cos, sin, store, mask, rows)
        x = self.model.norm(x)
        if self.aux_layers:
            x = torch.cat([x] + [aux[i] for i in self.aux_layers], dim=-1)
        return x[0] if rows is not None else x

    @classmethod
    def from_pretrained(cls, path: str, dtype=torch.float32, device="cpu") -> "LlamaModel":
        cfg = LlamaConfig.from_dir(path)
        with torch.device("meta"):
            model = cls(cfg)
        sd = load_state_dict(path)
        if cfg.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        missing = [k for k in model.state_dict() if k not in sd and not (cfg.tie_word_embeddings and k == "lm_head.weight")]
        if missing:
            raise ValueError(f"{path}: weights missing from the checkpoint: {missing[:5]}")
        model.load_state_dict({k: v.to(dtype) for k, v in sd.items() if k in model.state_dict()},
                              strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(cfg)
        return model.to(device=device, dtype=dtype).eval()


def load_state_dict(path: str) -> dict:
    """All tensors of a HF checkpoint directory (``*.safetensors`` or ``pytorch_model*.bin``)."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        from safetensors.torch import load_file

        sd = {}
        for f in files:
            sd.update(load_file(os.path.join(path, f)))
        return sd
    bins = sorted(f for f in os.listdir(path) if f.startswith("pytorch_model") and f.endswith(".bin"))
    if not bins:
        raise FileNotFoundError(f"{path}: no *.safetensors or pytorch_model*.bin weights found")
    sd = {}
    for f in bins:
        sd.update(torch.load(os.path.join(path, f), map_location="cpu", weights_only=True))
    return sd
