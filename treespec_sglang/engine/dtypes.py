"""The compute dtype: bfloat16 where the hardware runs it fast, float32 otherwise.

On this project's CPUs (Xeon with AVX512-BF16 / AMX) a bf16 linear at M=16 costs about what M=1
costs, while float32 grows with M (the cost curves in ``docs/results.md``), so bf16 is what makes a
tree verify cheap. ``"auto"`` picks it when the CPU has AMX or AVX512-BF16 (or on a CUDA device
that supports bf16) and float32 otherwise: on an AVX2-only CPU bf16 is emulated and slower than
float32 past one token per forward. An explicit ``"bfloat16"`` is honoured on every CPU (emulated
where it is not native). :func:`explain_dtype` says why a dtype was chosen; this module prints
nothing (the command line prints that reason on stdout, so an error stays one line on stderr).

Losslessness is defined against plain decoding *at the same dtype*. float32 is the bit-exact
mode: in bf16 a batched (tree) forward and a one-token forward round differently, so greedy
outputs may differ from plain greedy where the target's top two logits are within bf16 rounding
(README, "bf16 and exactness").
"""

from __future__ import annotations

from typing import Tuple, Union

import torch

__all__ = ["DTYPES", "resolve_dtype", "explain_dtype", "cpu_bf16", "dtype_name"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def cpu_bf16() -> Tuple[bool, str]:
    """Whether this CPU runs bf16 matmuls natively -> (yes, which feature or why not)."""
    cpu = getattr(torch, "cpu", None)
    for feat, fn in (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported")):
        check = getattr(cpu, fn, None)
        try:
            if check is not None and check():
                return True, feat
        except RuntimeError:
            pass
    try:  # older torch: read the flags the kernel reports
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    for flag, feat in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")):
        if flag in flags:
            return True, feat
    return False, "no AMX / AVX512-BF16 on this CPU"


def resolve_dtype(dtype: Union[str, torch.dtype, None] = "auto", device="cpu") -> torch.dtype:
    """``"auto"`` / a name / a ``torch.dtype`` -> ``torch.dtype``.

    Examples
    --------
    >>> resolve_dtype("float32")
    torch.float32
    >>> resolve_dtype("bf16")
    torch.bfloat16
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype}")
        return dtype
    name = "auto" if dtype is None else _ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name in DTYPES:
        return DTYPES[name]
    if name != "auto":
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if dev.type != "cpu":
        return torch.float32
    return torch.bfloat16 if cpu_bf16()[0] else torch.float32


def explain_dtype(dtype: Union[str, torch.dtype, None] = "auto", device="cpu") -> str:
    """One line: the dtype ``dtype`` resolves to on ``device``, and why.

    Examples
    --------
    >>> explain_dtype("float32")
    'float32 (asked for)'
    """
    got = dtype_name(resolve_dtype(dtype, device))
    auto = not isinstance(dtype, torch.dtype) and str(dtype or "auto").lower() == "auto"
    how = "auto" if auto else "asked for"
    if torch.device(device).type != "cpu" or not (auto or got == "bfloat16"):
        return f"{got} ({how})"
    ok, why = cpu_bf16()
    if ok:
        return f"{got} ({how}: this CPU has {why})"
    if auto:
        return f"{got} (auto: {why}, so bf16 would be emulated and slower)"
    return f"{got} (asked for: {why}, so bf16 is emulated and slower than float32 here)"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
