"""Up-front memory estimate of one ``SpecEngine.generate`` call, so a batch that cannot fit is refused with
numbers before any allocation (64 requests x budget 1024 on a 49k-vocab target is tens of GB of verify
logits alone), not killed by the allocator halfway through.

The estimate counts the tensors that scale with the batch: target and draft KV caches
``[layers, bs, kv_heads, max_len, head_dim]`` (x2 for K and V), the verify logits and processed
probabilities ``[bs, nodes, vocab]`` float32, the draft's child log-probs ``[bs, nodes, vocab_d]``
float32 (x2: the step's output and the policy's copy), the verify attention scores
``[bs, heads, nodes, max_len]`` float32 and the prefill hidden states. Weights are already resident.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["estimate_generate_bytes", "available_bytes", "check_fits"]

HEADROOM = 0.9  # refuse above this fraction of the available memory


def estimate_generate_bytes(target_cfg, draft_cfg, *, bs: int, max_prompt: int, max_new: int, max_nodes: int,
                            dtype: torch.dtype, draft_vocab: Optional[int] = None) -> dict:
    """Bytes per component (and ``total``) for ``bs`` requests, the longest prompt ``max_prompt``, ``max_new``
    new tokens and trees of up to ``max_nodes`` nodes (1 for plain decoding)."""
    el = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    max_len = max_prompt + max_new + max_nodes + 2
    t = target_cfg
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    parts = {
        "target_kv": 2 * t.num_hidden_layers * bs * t.num_key_value_heads * max_len * head_dim * el,
        "verify_logits": 2 * bs * max_nodes * t.vocab_size * 4,
        "verify_scores": bs * t.num_attention_heads * max_nodes * max_len * 4,
        "prefill_hidden": bs * max_prompt * t.hidden_size * 4,
    }
    if draft_cfg is not None and max_nodes > 1:
        d = draft_cfg
        d_head = getattr(d, "head_dim", None) or d.hidden_size // d.num_attention_heads
        parts["draft_kv"] = 2 * bs * d.num_key_value_heads * (max_len + 1) * d_head * el
        parts["draft_logprobs"] = 2 * bs * max_nodes * (draft_vocab or t.vocab_size) * 4
    parts["total"] = sum(parts.values())
    return parts


def available_bytes(device) -> Optional[int]:
    """Free memory on ``device`` (CUDA: ``mem_get_info``; CPU: ``MemAvailable``), None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(parts: dict, device, *, bs: int, max_nodes: int) -> None:
    """Raise ``ValueError`` with the estimate when the call would not fit in ``HEADROOM`` of free memory."""
    free = available_bytes(device)
    if free is None or parts["total"] <= HEADROOM * free:
        return
    gib = 2 ** 30
    top = sorted(((v, k) for k, v in parts.items() if k != "total"), reverse=True)[:3]
    detail = ", ".join(f"{k} {v / gib:.1f} GiB" for v, k in top)
    raise ValueError(f"this batch needs about {parts['total'] / gib:.1f} GiB ({bs} requests x up to {max_nodes} "
                     f"tree nodes: {detail}) but only {free / gib:.1f} GiB is available on {torch.device(device)}; "
                     f"send fewer requests per call or smaller budgets")
