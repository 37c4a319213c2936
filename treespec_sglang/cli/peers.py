"""Peers measured in the same run as our engine: Hugging Face ``transformers``
plain greedy ``generate`` and its prompt-lookup decoding (``prompt_lookup_num_tokens``).

Same prompts (token ids from our encoder), same dtype, bs 1, same ``max_new_tokens`` and EOS, so
tokens/s are comparable with :meth:`SpecEngine.generate`'s. Only timing and outputs are returned;
the model loads once per :class:`HFPeer`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

__all__ = ["HFPeer", "PeerRun", "PEERS"]

PEERS = ("hf-greedy", "hf-lookup")


@dataclass
class PeerRun:
    name: str
    seconds: float
    outputs: List[List[int]] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


class HFPeer:
    """``transformers.AutoModelForCausalLM`` on ``path`` in ``dtype`` (eager attention, CPU)."""

    def __init__(self, path: str, dtype: torch.dtype, eos_ids: Sequence[int], device="cpu"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self.device = torch.device(device)
        self.eos = sorted(set(int(e) for e in eos_ids))

    @torch.inference_mode()
    def generate(self, ids: Sequence[int], max_new_tokens: int, lookup: Optional[int] = None) -> List[int]:
        """Greedy continuation of one prompt (token ids); ``lookup`` = ``prompt_lookup_num_tokens``."""
        x = torch.tensor([list(ids)], device=self.device)
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                  eos_token_id=self.eos or None, pad_token_id=self.eos[0] if self.eos else 0,
                  attention_mask=torch.ones_like(x))
        if lookup:
            kw["prompt_lookup_num_tokens"] = int(lookup)
        out = self.model.generate(x, **kw)[0, x.shape[1]:].tolist()
        for i, t in enumerate(out):  # the same stop rule as SpecEngine: up to and including EOS
            if t in self.eos:
                return out[:i + 1]
        return out

    def run(self, name: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, lookup: Optional[int] = None,
            bar=None) -> PeerRun:
        """Time ``prompts`` one at a time (bs 1) -> :class:`PeerRun`."""
        outs, t0 = [], time.perf_counter()
        for p in prompts:
            outs.append(self.generate(p, max_new_tokens, lookup))
            if bar is not None:
                bar.update(len(outs[-1]))
        return PeerRun(name, time.perf_counter() - t0, outs)
