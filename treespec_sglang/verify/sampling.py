"""Target-distribution processing shared by plain sampling and speculative verification.

Lossless speculative sampling must reproduce *exactly* the distribution plain sampling draws
from, so both go through :func:`target_probs` (temperature, then top-k, then top-p on the
renormalised distribution, SGLang's sampler order). Temperature 0 means greedy: the
distribution is one-hot at ``argmax`` (first index on ties, ``torch.argmax``'s rule).
"""

from __future__ import annotations

import numbers
from typing import Optional, Union

import torch

__all__ = ["target_probs", "sample_probs", "sample", "as_row_tensor", "uniform", "check_sampling", "check_scalar",
           "SAMPLING_RANGES", "GREEDY_BELOW", "is_greedy"]

Num = Union[float, int, torch.Tensor]


# a temperature below this samples greedily (SGLang's convention, its _SAMPLING_EPS): dividing the logits by a
# smaller one overflows to inf and softmax gives NaN
GREEDY_BELOW = 1e-6


def is_greedy(temperature) -> bool:
    """Whether a host-side ``temperature`` means greedy decoding (a tensor is never read: its rows decide on the
    device, :func:`target_probs`)."""
    return not isinstance(temperature, torch.Tensor) and temperature < GREEDY_BELOW


# scalar sampling parameters: (low, high, integer); top_k <= 0 disables top-k, top_p = 1 disables top-p
SAMPLING_RANGES = {"temperature": (0.0, 1e4, False), "top_k": (-2 ** 31, 2 ** 31, True), "top_p": (1e-9, 1.0, False)}


def check_scalar(name: str, value, lo: float, hi: float, integer: bool = False):
    """Validate one scalar parameter (numpy scalars accepted, bools and NaN refused); returns it as int / float."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not lo <= value <= hi:
        what = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {what} in [{lo}, {hi}], got {value!r}")
    return int(value) if integer else float(value)


def check_sampling(temperature: Num = 0.0, top_k: Num = -1, top_p: Num = 1.0) -> None:
    """Raise ``ValueError`` naming the field and range for a bad scalar sampling parameter (tensors are
    checked for shape where they are used). Engines call it before any compute."""
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if not isinstance(value, torch.Tensor):
            lo, hi, integer = SAMPLING_RANGES[name]
            check_scalar(name, value, lo, hi, integer)


def as_row_tensor(value: Num, bs: int, device, dtype, name: str, lo: float, hi: float) -> torch.Tensor:
    """Broadcast a scalar or ``[bs]`` tensor parameter to ``[bs]`` and range-check scalars."""
    if isinstance(value, torch.Tensor):
        if value.shape not in ((), (bs,)):
            raise ValueError(f"{name} must be a scalar or a [{bs}] tensor, got shape {tuple(value.shape)}")
        return value.to(device=device, dtype=dtype).expand(bs)
    value = check_scalar(name, value, lo, hi, integer=not dtype.is_floating_point)
    return torch.full((bs,), value, dtype=dtype, device=device)


def target_probs(logits: torch.Tensor, temperature: Num = 0.0, top_k: Num = -1, top_p: Num = 1.0) -> torch.Tensor:
    """Processed target distribution.

    Parameters
    ----------
    logits : torch.Tensor
        ``[bs, ..., vocab]`` float.
    temperature : float or ``[bs]`` tensor
        0 (below :data:`GREEDY_BELOW`, as in SGLang) = greedy (one-hot argmax).
    top_k : int or ``[bs]`` tensor
        Keep the k most likely tokens; <= 0 disables.
    top_p : float or ``[bs]`` tensor
        Keep the smallest prefix of the sorted distribution with mass >= top_p; 1 disables.

    Returns
    -------
    torch.Tensor
        ``[bs, ..., vocab]`` float32 probabilities.

    Examples
    --------
    >>> [round(x, 3) for x in target_probs(torch.tensor([[0.0, 1.0, 2.0]]), 1.0, top_k=2)[0].tolist()]
    [0.0, 0.269, 0.731]
    """
    bs, V = logits.shape[0], logits.shape[-1]
    dev = logits.device
    shape = (bs,) + (1,) * (logits.dim() - 1)
    R = SAMPLING_RANGES
    T = as_row_tensor(temperature, bs, dev, torch.float32, "temperature", *R["temperature"][:2]).view(shape)
    k = as_row_tensor(top_k, bs, dev, torch.int64, "top_k", *R["top_k"][:2]).view(shape)
    p = as_row_tensor(top_p, bs, dev, torch.float32, "top_p", *R["top_p"][:2]).view(shape)
    x = logits.float()
    greedy = torch.nn.functional.one_hot(x.argmax(-1), V).float()
    # host-side shortcuts when a parameter is a plain number that disables a stage (no sync)
    if is_greedy(temperature):
        return greedy
    sampled = T >= GREEDY_BELOW  # the other rows are greedy
    x = x / torch.where(sampled, T, 1.0)
    if isinstance(top_k, torch.Tensor) or top_k > 0:
        # top-k: drop everything below the k-th largest value (ties at the k-th value are kept)
        k_eff = torch.where(k > 0, k.clamp(max=V), V)
        sorted_x = torch.sort(x, dim=-1, descending=True).values
        kth = torch.gather(sorted_x, -1, (k_eff - 1).expand(*x.shape[:-1], 1))
        x = torch.where(x < kth, float("-inf"), x)
    probs = torch.softmax(x, dim=-1)
    if isinstance(top_p, torch.Tensor) or top_p < 1:
        probs = top_p_renorm(probs, p)  # on the renormalised top-k distribution
    return torch.where(sampled, probs, greedy)


def top_p_renorm(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep token j if the mass strictly before it (descending order) is < p, then renormalise.

    probs ``[..., vocab]``; p broadcastable to ``[..., 1]`` (a row of p = 1 keeps every token).
    Example: probs [0.5, 0.3, 0.2], p 0.6 -> [0.625, 0.375, 0.0].
    """
    sp, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    drop_sorted = (sp.cumsum(-1) - sp) >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    kept = torch.where(drop, 0.0, probs)
    # a row of p = 1 is left as it is (as a scalar 1 skips this function): a float32 cumsum reaches 1.0 before a
    # long tail ends, and renormalising what it kept would move every value
    return torch.where(p < 1, kept / kept.sum(-1, keepdim=True), probs)


def uniform(shape, device, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``U[0, 1)`` float32 draws from ``generator`` (sync-free)."""
    return torch.rand(shape, device=device, generator=generator)


def sample_probs(probs: torch.Tensor, generator: Optional[torch.Generator] = None,
                 u: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse-CDF sample from ``[bs, vocab]`` probabilities (need not be normalised) -> ``[bs]`` int64.

    Zero-probability tokens are never drawn. ``u`` (``[bs]`` in [0, 1)) may be passed in.
    """
    if u is None:
        u = uniform(probs.shape[:-1], probs.device, generator)
    cdf = probs.cumsum(-1)
    target = u * cdf[..., -1]
    idx = torch.searchsorted(cdf, target[..., None], right=True)[..., 0]
    return idx.clamp(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, temperature: Num = 0.0, top_k: Num = -1, top_p: Num = 1.0,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Plain (non-speculative) sampling: ``[bs, vocab]`` logits -> ``[bs]`` int64 tokens."""
    return sample_probs(target_probs(logits, temperature, top_k, top_p), generator)
