"""Pure-torch stand-ins for the ``sgl_kernel`` CPU ops SGLang 0.5.23's CPU engine needs.

SGLang runs on a CPU (``SGLANG_USE_CPU_ENGINE=1``, ``device="cpu"``, ``attention_backend="intel_amx"``)
once a handful of compiled ``sgl_kernel`` CPU ops exist; PyPI's ``sglang-kernel`` ships no CPU build.
:func:`install` provides them where, and only where, SGLang runs on the CPU and no real ``sgl_kernel``
can be imported:

| op (module ``sgl_kernel`` / ``torch.ops.sgl_kernel``) | SGLang call site | here |
|---|---|---|
| ``decode_attention_cpu``, ``extend_attention_cpu`` | ``intel_amx_backend`` (torch.ops) | :mod:`.attention` |
| ``build_draft_decode_metadata_cpu`` | ``IntelAMXMultiStepDraftBackend`` | :mod:`.kernels` |
| ``assign_req_to_token_pool_cpu`` | ``mem_cache/allocation.py`` | :mod:`.kernels` |
| ``assign_draft_cache_locs_contiguous_cpu``, ``assign_extend_cache_locs_cpu`` | ``speculative/cache_locs.py`` | :mod:`.kernels` |
| ``fill_bonus_tokens_cpu``, ``fill_accept_out_cache_loc_cpu`` | ``speculative/eagle.py`` | :mod:`.kernels` |
| ``build_tree_kernel_efficient_cpu``, ``verify_tree_greedy_cpu`` | ``speculative/spec_tree.py`` | :mod:`.kernels` |
| ``copy_all_layer_kv_cache_cpu`` | ``kvcache/cache_move.py`` | :mod:`.kernels` |

How they are found: SGLang imports several of them at module import time (before any plugin
runs), and its scheduler processes are spawned. :func:`install` therefore (1) puts a module
``sgl_kernel`` into ``sys.modules`` for this process and (2) appends ``shim/`` (a directory holding
only a tiny ``sgl_kernel`` package that re-exports these ops) to the *end* of ``sys.path``, which
multiprocessing hands to every spawned child, so a real ``sgl_kernel`` anywhere on the path always
wins. ``convert_weight_packed`` is deliberately absent, so SGLang finds no AMX GEMM kernels and its
layers run their ``forward_native`` torch paths; :func:`install` tells SGLang's platform facts that
the AMX attention path is usable (else server-arg post-processing rewrites ``intel_amx`` to
``torch_native``, which refuses EAGLE).

With the stand-ins in place, ``register()`` also points SGLang's overlap scheduler at a torch stand-in for
the one Triton kernel it calls (:mod:`.overlap`): SGLang runs that scheduler on a CPU only when the test bed
turns it on (:func:`.host.allow_cpu_overlap`).

``register()`` calls :func:`install`; a script that builds ``sgl.Engine`` on a CPU machine calls
``treespec_sglang.plugin.cpu.install()`` before importing ``sglang.srt`` modules (``import sglang``
alone is fine), because SGLang's engine module imports the ops before it loads plugins.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types

__all__ = ["install", "activate", "active", "should_install", "OPS", "SHIM_DIR", "CPU_ENV"]

CPU_ENV = "SGLANG_USE_CPU_ENGINE"
SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")
# torch.library schemas, as SGLang 0.5.23 calls the two ops it reaches through torch.ops
_SCHEMAS = {
    "decode_attention_cpu":
        "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, float v_scale, "
        "Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, "
        "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()",
    "extend_attention_cpu":
        "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
        "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
        "int? max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, "
        "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()",
}
_STATE = {"module": None, "library": None}


def _ops() -> dict:
    from . import attention, kernels

    names = [n for n in kernels.__all__ if n.endswith("_cpu")]
    return {**{n: getattr(kernels, n) for n in names},
            "decode_attention_cpu": attention.decode_attention_cpu,
            "extend_attention_cpu": attention.extend_attention_cpu}


OPS = ("decode_attention_cpu", "extend_attention_cpu", "build_draft_decode_metadata_cpu",
       "assign_req_to_token_pool_cpu", "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
       "fill_bonus_tokens_cpu", "fill_accept_out_cache_loc_cpu", "build_tree_kernel_efficient_cpu",
       "verify_tree_greedy_cpu", "copy_all_layer_kv_cache_cpu")


def _real_sgl_kernel_present() -> bool:
    mod = sys.modules.get("sgl_kernel")
    if mod is not None:
        return not getattr(mod, "__treespec_standin__", False)
    saved = list(sys.path)
    try:  # look for it everywhere except our own shim
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != SHIM_DIR]
        return importlib.machinery.PathFinder.find_spec("sgl_kernel") is not None
    finally:
        sys.path[:] = saved


def should_install() -> bool:
    """True when SGLang runs on the CPU (``SGLANG_USE_CPU_ENGINE``) and no real ``sgl_kernel`` exists."""
    on_cpu = os.environ.get(CPU_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    return on_cpu and not _real_sgl_kernel_present()


def active() -> bool:
    """Whether this process runs on our stand-ins."""
    mod = sys.modules.get("sgl_kernel")
    return bool(mod is not None and getattr(mod, "__treespec_standin__", False))


def _register_torch_ops(ops: dict) -> None:
    import torch

    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        if not hasattr(torch.ops.sgl_kernel, name):
            lib.define(schema)
            lib.impl(name, ops[name], "CPU")
    _STATE["library"] = lib  # keep the registrations alive


def build_module() -> types.ModuleType:
    """The ``sgl_kernel`` stand-in module of this process (created and its torch ops registered once)."""
    if _STATE["module"] is None:
        ops = _ops()
        _register_torch_ops(ops)
        mod = types.ModuleType("sgl_kernel", "treespec-sglang torch stand-ins for sgl_kernel's CPU ops")
        mod.__dict__.update(ops)
        mod.__treespec_standin__ = True
        mod.__all__ = list(OPS)
        _STATE["module"] = mod
    return _STATE["module"]


def _keep_amx_attention() -> None:
    try:
        from sglang.srt.runtime_context import override_platform
    except ImportError:  # sglang absent or without platform facts: nothing to keep
        return
    override_platform(has_amx=True).install()


def activate() -> None:
    """Make this process (and the processes it spawns) use the stand-ins, unconditionally."""
    sys.modules["sgl_kernel"] = build_module()
    if SHIM_DIR not in sys.path:
        sys.path.append(SHIM_DIR)  # spawned children get sys.path from multiprocessing


def install(force: bool = False) -> bool:
    """Provide the stand-ins if SGLang runs on the CPU without a real ``sgl_kernel``; idempotent.

    Returns whether this process now uses the stand-ins. A real ``sgl_kernel`` is never shadowed:
    with one importable this does nothing, and the shim directory only ever goes to the end of
    ``sys.path``. ``force`` skips the ``SGLANG_USE_CPU_ENGINE`` check (tests), never the real-kernel one.
    """
    if not active():
        if _real_sgl_kernel_present() or not (force or should_install()):
            return False
        activate()
    _keep_amx_attention()
    return True
