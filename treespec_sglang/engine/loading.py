"""Resolve ``target`` / ``draft`` names to loaded models and a tokenizer."""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..models import EagleDraftHead, LlamaModel, demo_target, load_draft_head
from ..models.demo import DEMO_NAME, cache_dir

__all__ = ["load_models", "load_token_map", "read_token_map", "save_token_map", "resolve_target", "demo_draft_dir", "eagle3_draft_dir", "TOKEN_MAP"]


def resolve_target(target: str) -> str:
    if target == DEMO_NAME:
        return demo_target()
    if not os.path.isdir(target):
        raise FileNotFoundError(f"target {target!r} is neither {DEMO_NAME!r} nor a Hugging Face model directory")
    return target


def demo_draft_dir() -> str:
    """The shipped draft head for the demo target (inside the package), if present."""
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "smollm2-135m-eagle")


def eagle3_draft_dir() -> str:
    """The shipped EAGLE-3 head for the demo target (inside the package; ``--draft demo-eagle3``)."""
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "smollm2-135m-eagle3")


def _tokenizer(path: str):
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


TOKEN_MAP = "token_map.pt"


def read_token_map(path: str) -> torch.Tensor:
    """``[vocab_d]`` int64 target ids from a token-map file (SGLang ``--speculative-token-map`` format)."""
    return torch.as_tensor(torch.load(path, weights_only=True), dtype=torch.int64)


def save_token_map(token_map: torch.Tensor, path: str) -> None:
    """Write ``[vocab_d]`` target ids as a list of ints (what SGLang's ``load_token_map`` reads)."""
    torch.save(token_map.tolist(), path)


def load_token_map(draft_dir: str) -> Optional[torch.Tensor]:
    """The token map in ``<draft_dir>/token_map.pt``, or None when the draft has none."""
    path = os.path.join(draft_dir, TOKEN_MAP)
    return read_token_map(path) if os.path.isfile(path) else None


def load_models(target: str, draft: Optional[str], dtype=torch.float32, seed: int = 0):
    """-> (LlamaModel, draft head (EAGLE or EAGLE-3), tokenizer or None, token map or None). A draft directory is checked
    before the target loads (a typo fails at once, not after the demo target's first-run conversion)."""
    if draft not in (None, "demo", "demo-eagle3"):
        EagleDraftHead.files(draft)
    path = resolve_target(target)
    model = LlamaModel.from_pretrained(path, dtype=dtype)
    d = None
    if draft is None:
        head = EagleDraftHead.for_target(model.config, seed=seed, dtype=dtype)
    elif draft == "demo-eagle3":
        d = eagle3_draft_dir()
        head = load_draft_head(d, dtype=dtype)
    elif draft == "demo":
        d = demo_draft_dir()
        if os.path.isfile(os.path.join(d, "model.safetensors")):
            head = load_draft_head(d, dtype=dtype)
        else:  # until a trained head ships: a seeded random head, saved once in SGLang format
            d = os.path.join(cache_dir(), "smollm2-135m-eagle-random")
            if not os.path.isfile(os.path.join(d, "model.safetensors")):
                EagleDraftHead.for_target(model.config, seed=seed).save(d, dtype=torch.float32)
            head = EagleDraftHead.load(d, dtype=dtype)
    else:
        d = draft
        head = load_draft_head(draft, dtype=dtype)
    if getattr(head, "owns_lm_head", False):  # EAGLE-3: its d2t is its vocabulary; the engine checks the rest
        return model, head, _tokenizer(path), None
    if head.config.hidden_size != model.config.hidden_size or head.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"draft head hidden/vocab ({head.config.hidden_size}, {head.config.vocab_size}) do not match "
                         f"the target's ({model.config.hidden_size}, {model.config.vocab_size})")
    return model, head, _tokenizer(path), (load_token_map(d) if d is not None else None)
