"""The reference engine's model calls, as one typed public object the round's stages take.

:class:`ModelCalls` is everything a round does with the two models and the tokenizer: encode prompts, prefill
the target, turn hidden states into target logits or draft log-probs, map draft ids to target ids (a token map
or an EAGLE-3 head's ``d2t``) and feed committed tokens to the draft (its draft extend). ``SpecEngine`` builds it
(``engine.calls``) and rebuilds its draft head when the token map changes; the stages (:mod:`.round`,
:mod:`.expander`), the cost probes (:mod:`.cost`) and the exactness check (:mod:`.exactness`) call it instead of
the engine's internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

import torch

from .kv_cache import prefill

__all__ = ["ModelCalls"]


@dataclass
class ModelCalls:
    """The two models, their tokenizer and the draft's vocabulary.

    Attributes
    ----------
    target, draft : the target model and the draft head (``models/``)
    draft_head : ``[..., hidden] -> [..., vocab_d]`` the draft's LM head (the target's rows of the token map, or
        an EAGLE-3 head's own)
    token_map : ``[vocab_d]`` int64 target id of each draft id, or None (the draft scores the whole vocabulary)
    tokenizer : the target's tokenizer, or None (token ids only)
    device, dtype : where and in what the models run
    """

    target: torch.nn.Module
    draft: torch.nn.Module
    draft_head: Callable
    token_map: Optional[torch.Tensor]
    tokenizer: object
    device: torch.device
    dtype: torch.dtype

    def encode(self, prompts: Sequence[Union[str, Sequence[int]]], chat: bool = True) -> List[List[int]]:
        """Token ids of each prompt (text through the chat template unless ``chat=False``); raises
        ``ValueError`` naming the first bad prompt."""
        return [self.encode_one(i, p, chat) for i, p in enumerate(prompts)]

    def encode_one(self, i: int, p: Union[str, Sequence[int]], chat: bool) -> List[int]:
        """Prompt ``i``'s token ids (``ValueError`` naming it when it is empty, text without a tokenizer, or
        ids outside the vocabulary)."""
        vocab = self.target.config.vocab_size
        if isinstance(p, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {i} is text but this model has no tokenizer: pass token ids")
            if chat and getattr(self.tokenizer, "chat_template", None):
                ids = self.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                         add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if not isinstance(ids, list) else ids
            else:
                ids = self.tokenizer(p)["input_ids"]
            if not ids:
                raise ValueError(f"prompt {i} is empty (0 tokens)")
            return [int(x) for x in ids]
        ids = [int(x) for x in p]
        if not ids or min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt {i}: token ids must be non-empty and in [0, {vocab - 1}]")
        return ids

    def prefill(self, ids: List[List[int]], max_len: int):
        """The target over each prompt: ``(cache, inputs [bs, L], hidden [bs, L, H'], lens [bs], logits [bs, vocab])``,
        the logits at each prompt's last token."""
        cache, inp, hidden, lens = prefill(self.target, ids, max_len)
        last = torch.gather(hidden, 1, (lens - 1)[:, None, None].expand(len(ids), 1, hidden.shape[-1]))[:, 0]
        return cache, inp, hidden, lens, self.logits(last)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` (or EAGLE-3's ``[..., hidden * 4]``, final-norm states first) -> ``[..., vocab]`` float32."""
        return self.target.lm_head(h[..., :self.target.config.hidden_size]).float()

    def draft_logprobs(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` draft features -> ``[..., vocab_d]`` draft log-probs (over draft ids)."""
        return torch.log_softmax(self.draft_head(h).float(), dim=-1)

    def to_target_ids(self, tokens: torch.Tensor, is_root: torch.Tensor) -> torch.Tensor:
        """``[...]`` draft ids -> target ids for non-root nodes (the root is already a target id); -1 stays."""
        if self.token_map is None:
            return tokens
        keep = is_root | (tokens < 0)
        return torch.where(keep, tokens, self.token_map[torch.where(keep, 0, tokens)])

    def draft_extend(self, dcache, tokens: torch.Tensor, feats: torch.Tensor, start: torch.Tensor,
                     count: torch.Tensor, kv: int):
        """Feed ``count[b]`` committed pairs (``tokens`` ``[bs, m]``, target ``feats``) starting at position
        ``start[b]``; return the last pair's draft feature ``[bs, hidden]`` and its log-probs ``[bs, vocab_d]``
        (the next root's). ``kv`` (host) >= ``max(start) + m``."""
        bs, m = tokens.shape
        pos = start[:, None] + torch.arange(m, device=self.device)
        col = torch.arange(kv, device=self.device)[None, None, :]
        mask = (col >= 1) & (col <= pos[:, :, None])
        out = self.draft(tokens, feats[..., self.draft.feature_columns].to(self.dtype), pos, dcache.stores(pos, kv)[0],
                         mask)
        last = torch.gather(out, 1, (count - 1)[:, None, None].expand(bs, 1, out.shape[-1]))[:, 0]
        return last, self.draft_logprobs(last)
