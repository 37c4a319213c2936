"""Models: a Llama-family target with explicit KV/mask control, the EAGLE and EAGLE-3 draft heads, the demo target."""

import json
import os

from .demo import demo_target
from .draft_head import DRAFT_ARCH, EagleDraftHead
from .eagle3_head import EAGLE3_ARCH, Eagle3DraftHead
from .llama import LlamaConfig, LlamaModel

__all__ = ["LlamaConfig", "LlamaModel", "EagleDraftHead", "Eagle3DraftHead", "demo_target", "load_draft_head",
           "draft_arch"]


def draft_arch(path: str) -> str:
    """The architecture a draft directory's ``config.json`` names (``LlamaForCausalLMEagle`` or
    ``LlamaForCausalLMEagle3``, what SGLang's ``--speculative-algorithm`` EAGLE / EAGLE3 must match);
    raises ``ValueError`` naming the field for anything else."""
    cfg_path, _ = EagleDraftHead.files(path)
    with open(cfg_path) as f:
        archs = json.load(f).get("architectures") or []
    for a in (EAGLE3_ARCH, DRAFT_ARCH):
        if a in archs:
            return a
    raise ValueError(f"draft head: {cfg_path} architectures must include {DRAFT_ARCH!r} or {EAGLE3_ARCH!r}, got {archs}")


def load_draft_head(path: str, dtype=None):
    """Load the EAGLE or EAGLE-3 head in ``path`` (dispatch on :func:`draft_arch`)."""
    import torch

    dtype = dtype or torch.float32
    cls = Eagle3DraftHead if draft_arch(os.fspath(path)) == EAGLE3_ARCH else EagleDraftHead
    return cls.load(path, dtype=dtype)
