"""A ``generate`` call's requests: their result records and their admission.

:func:`admit` turns the call's prompts and policy dicts into the requests that run; a request whose prompt
or policy dict is invalid gets its ``error`` set and no tokens, and the rest run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from ..policies import PolicyParams, parse_spec
from ..policies.token_cap import split_batch_option
from .options import GenerateOptions

__all__ = ["RequestStats", "GenerationResult", "Admitted", "admit", "PLAIN"]

PLAIN = {"policy": "chain", "length": 0}  # a root-only tree: one target token per round


@dataclass
class RequestStats:
    """Per-request counters; ``rounds`` counts target forwards (prefill included)."""

    policy: Optional[str] = None
    rounds: int = 0
    draft_forwards: int = 0
    accepted: List[int] = field(default_factory=list)  # accepted draft tokens per verify round
    tree_sizes: List[int] = field(default_factory=list)  # nodes per verify round (root included)
    time_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify round (accepted + bonus), EAGLE's tau."""
        return 1.0 + sum(self.accepted) / len(self.accepted) if self.accepted else 1.0

    @property
    def delta(self) -> float:
        """Draft forwards per verify round (TALON §5.3's draft cost per target forward)."""
        return self.draft_forwards / len(self.accepted) if self.accepted else 0.0


@dataclass
class GenerationResult:
    token_ids: List[int]
    text: Optional[str]
    stats: RequestStats
    error: Optional[str] = None


@dataclass
class Admitted:
    """The call's requests: ``results`` (one per prompt, refused ones with ``error`` set) and, for the requests
    that run, in call order: their index in the call (``ok``), prompt ids, parsed policy and whether they share
    the token cap. ``plain``: none of them speculates (every policy dict was None)."""

    results: List[GenerationResult]
    ok: List[int]
    ids: List[List[int]]
    params: List[PolicyParams]
    shares: List[bool]
    plain: bool


def admit(engine, prompts, policy, o: GenerateOptions) -> Admitted:
    """Encode each prompt (``engine.calls.encode_one``) and parse each policy dict; a bad one refuses its request."""
    if isinstance(prompts, str):
        prompts = [prompts]  # one text prompt, not one prompt per character
    ids, bad_prompt = [], {}
    ctx = getattr(engine.target.config, "max_position_embeddings", None)
    for i, p in enumerate(prompts):
        try:
            one = engine.calls.encode_one(i, p, o.chat)
            if ctx and len(one) + o.max_new_tokens > ctx:
                raise ValueError(f"prompt {i} has {len(one)} tokens; with max_new_tokens {o.max_new_tokens} "
                                 f"that is {len(one) + o.max_new_tokens} > the model's context {ctx} "
                                 f"(max_position_embeddings): shorten the prompt or max_new_tokens")
            ids.append(one)
        except ValueError as e:
            ids.append(None)
            bad_prompt[i] = str(e)
    specs = list(policy) if isinstance(policy, (list, tuple)) else [policy] * len(ids)
    if len(specs) != len(ids):
        raise ValueError(f"policy must be one dict or a list of {len(ids)} (one per prompt), got {len(specs)}")
    results = [GenerationResult([], None, RequestStats(policy=(s or {}).get("policy") if isinstance(s, dict) else None))
               for s in specs]
    ok, parsed, shares = [], [], []
    for i, s in enumerate(specs):
        if i in bad_prompt:
            results[i].error = f"request {i}: {bad_prompt[i]}"
            continue
        try:
            s, share = split_batch_option(s)
            parsed.append(parse_spec(s if s is not None else PLAIN))
            shares.append(share)
            ok.append(i)
        except ValueError as e:
            results[i].error = f"request {i}: {e}"
    return Admitted(results, ok, [ids[i] for i in ok], parsed, shares, all(specs[i] is None for i in ok))
