"""Where ragged verify (:mod:`.ragged`) applies: its setting (``TREESPEC_RAGGED_VERIFY``), the attention backends
it has a path for, and the parallelism and target models it refuses (no sglang import: SGLang's objects are read
by attribute and class name).

A server that asks for ragged verify where it cannot run is refused at start with the reason
(:func:`check_ragged_parallelism`, :func:`check_ragged_model`); ``auto`` (the default) verifies such a batch padded.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

from .config import env_switch
from .settings import derived, env

__all__ = ["ENV_RAGGED", "ragged_setting", "ragged_mode", "ragged_tuned", "dp_attention", "check_ragged_parallelism",
           "ragged_unsupported", "check_ragged_model"]

ENV_RAGGED = "TREESPEC_RAGGED_VERIFY"


@derived
def ragged_setting() -> Union[bool, str]:
    """``TREESPEC_RAGGED_VERIFY`` (:func:`.config.env_switch`): ``"auto"`` (unset), ``"tuned"``, True or False;
    a bad value raises ValueError naming the variable (checked at server start, with ``TREESPEC_RAGGED_TUNING``,
    :func:`.server_hooks.check_environment`)."""
    return env_switch(ENV_RAGGED, "auto", extra=("auto", "tuned"))


def ragged_mode(model_runner) -> Optional[str]:
    """Which ragged path applies to this runner's attention backend, or None (padded verify).

    ``TREESPEC_RAGGED_VERIFY`` unset / ``auto``: the CPU ``intel_amx`` backend only, tuned (:func:`ragged_tuned`);
    ``1``: also SGLang's FlashInfer backend, every compactable verify ragged (eager for ragged batches; opt-in until
    it has been measured on a GPU); ``tuned``: both backends, each verify ragged or padded as :mod:`.ragged_tuner`
    measured faster at its batch size; ``0``: off.
    Under attention data parallelism, and for a target :func:`ragged_unsupported` refuses, every verify is padded
    (``auto``; ``1`` and ``tuned`` are refused at start, :func:`check_ragged_parallelism`,
    :func:`check_ragged_model`).
    """
    setting = ragged_setting()
    if setting is False:
        return None
    kind = _backend_kind(type(getattr(model_runner, "attn_backend", None)))
    if kind is None or dp_attention(getattr(model_runner, "server_args", None)) or _unsupported(model_runner):
        return None
    return kind if kind == "cpu" or setting in (True, "tuned") else None


def ragged_tuned(mode: str) -> bool:
    """Whether a verify on ragged path ``mode`` (:func:`ragged_mode`, not None) runs ragged or padded as
    :mod:`.ragged_tuner` measured faster: under ``tuned``, and under ``auto`` on the CPU, where fewer rows are not
    always cheaper (a float32 matmul's time steps with its row count, by the CPU's own pattern: on a Xeon 13-15 rows
    cost more than 16, on an AMD EPYC 3 rows more than 8), so that ``auto`` is never slower than padded; under ``1``
    every compactable verify runs ragged."""
    setting = ragged_setting()
    return setting == "tuned" or (setting == "auto" and mode == "cpu")


def _unsupported(model_runner) -> bool:
    """:func:`ragged_unsupported` once per runner (kept on it)."""
    seen = getattr(model_runner, "_treespec_ragged_unsupported", None)
    if seen is None:
        seen = model_runner._treespec_ragged_unsupported = ragged_unsupported(model_runner) is not None
    return seen


def dp_attention(server_args) -> bool:
    """Whether the server runs attention data parallel (``--enable-dp-attention``, an attention-DP width > 1)."""
    width = getattr(server_args, "attn_dp_size", None)
    return bool(getattr(server_args, "enable_dp_attention", False)) or (isinstance(width, int) and width > 1)


def check_ragged_parallelism(server_args) -> None:
    """At server start: ``TREESPEC_RAGGED_VERIFY=1`` / ``tuned`` with attention data parallelism raises ValueError.
    SGLang fixes every DP group's verify token count (``bs * N``) before the forward and gathers across groups
    in the MLP, so one group running ragged beside another running padded would not line up."""
    setting = ragged_setting()
    if setting in (True, "tuned") and dp_attention(server_args):
        raise ValueError(f"treespec: {ENV_RAGGED}={env(ENV_RAGGED).strip()} cannot run with attention data "
                         "parallelism (--enable-dp-attention): every DP group verifies bs * N tokens there; unset it "
                         "(auto: padded under DP attention) or set 0")


_KINDS = {"IntelAMXAttnBackend": "cpu", "FlashInferAttnBackend": "flashinfer"}


@functools.lru_cache(maxsize=16)
def _backend_kind(cls) -> Optional[str]:
    """``"cpu"`` for SGLang's ``IntelAMXAttnBackend``, ``"flashinfer"`` for its ``FlashInferAttnBackend``, else
    None: by class name along the MRO (no sglang import), once per class. A subclass of either defined in SGLang
    itself is another backend with its own verify metadata (``TRTLLMHAAttnBackend`` derives from FlashInfer's and
    never builds the arguments the ragged path compacts): None; a subclass from outside SGLang keeps its base's."""
    for c in cls.__mro__:
        if c.__name__ in _KINDS:
            return _KINDS[c.__name__]
        if c.__module__.split(".")[0] == "sglang":
            return None
    return None


def ragged_unsupported(model_runner) -> Optional[str]:
    """Why the target model behind ``model_runner`` (SGLang's ``ModelRunner``) cannot verify ragged, or None.
    The ragged path compacts ``input_ids`` / ``positions`` / ``out_cache_loc`` and FlashInfer's single-wrapper
    arguments; a model or server that carries more per-token state in the verify batch is refused: sliding-window
    or cross attention (FlashInfer's second wrapper and its KV write slots), multimodal rotary positions
    (``mrope_positions``), LoRA adapters (per-request token segments), expert parallelism (its padded token count),
    routed experts returned to clients (their capture indexes the padded verify's tokens)."""
    cfg = getattr(model_runner, "model_config", None)
    args = getattr(model_runner, "server_args", None)
    if getattr(model_runner, "sliding_window_size", None) is not None:
        return "a sliding-window attention model"
    if getattr(cfg, "is_encoder_decoder", False):
        return "an encoder-decoder model (cross attention)"
    if getattr(cfg, "model_is_mrope", False):
        return "a model with multimodal rotary positions (mrope)"
    if getattr(args, "enable_lora", None) or getattr(args, "lora_paths", None):
        return "LoRA adapters (--enable-lora / --lora-paths)"
    ep = getattr(args, "ep_size", 1)
    if isinstance(ep, int) and ep > 1:
        return f"expert parallelism (--ep-size {ep})"
    if getattr(args, "enable_return_routed_experts", False):  # its capturer reads the padded verify's token slots
        return "routed experts returned (--enable-return-routed-experts)"
    return None


def check_ragged_model(model_runner) -> None:
    """At server start: ``TREESPEC_RAGGED_VERIFY=1`` / ``tuned`` on a target :func:`ragged_unsupported` refuses
    raises ValueError naming the variable and the reason (``auto`` verifies such a model padded)."""
    setting = ragged_setting()
    reason = ragged_unsupported(model_runner) if setting in (True, "tuned") else None
    if reason is not None:
        raise ValueError(f"treespec: {ENV_RAGGED}={env(ENV_RAGGED).strip()} cannot verify ragged with {reason}; "
                         "unset it (auto: padded verify for this model) or set 0")
