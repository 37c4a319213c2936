"""FlashInfer's attention modules for SGLang's FlashInfer backend, compiled ahead of a GPU session.

The GPU machine has no FlashInfer and no network; FlashInfer compiles each kernel module with nvcc the first time
SGLang asks for it, minutes of a device call. This builds the modules SGLang's FlashInfer backend asks for when
it serves the demo target and its EAGLE heads in bf16 (FlashInfer has no float32 kernels) for ``--arch`` (sm_90a:
H100 and H200) with this machine's nvcc, and copies each ``.so`` to ``DEST/<name>/<name>.so``: FlashInfer loads a
module found in its package's ``data/aot`` folder as is, and compiles any other one as before (the step's log then
names it: add it to :func:`module_specs`).

Run with the FlashInfer package to build for on ``PYTHONPATH`` (``bench/gpu_flashinfer.sh pack`` does)::

    python bench/gpu_flashinfer_aot.py DEST [--arch 9.0a] [--head-dim 64] [--only NAME_PART]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time


def module_specs(head_dim: int):
    """``[(label, JitSpec)]``: the batch prefill modules (FA2, primary and with independent K/V strides: the
    verify's custom mask, extend, and decode on tensor cores at a GQA group of 3; FA3: Hopper's ragged and paged
    prefill without a mask) and the batch decode module, bf16 queries, KV and outputs, int32 indices, no
    positional encoding in the kernel, no sliding window, no logits cap."""
    import torch
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.prefill import _gen_batch_prefill_independent_paged_module, _gen_batch_prefill_primary_module

    bf16, i32 = torch.bfloat16, torch.int32
    prefill = (bf16, bf16, bf16, i32, head_dim, head_dim, 0, False, False, False)
    return [("fa2 prefill", _gen_batch_prefill_primary_module("fa2", *prefill)),
            ("fa2 prefill, independent K/V strides", _gen_batch_prefill_independent_paged_module("fa2", *prefill)),
            ("fa3 prefill (sm90)", gen_batch_prefill_module("fa3", *prefill)),
            ("decode", gen_batch_decode_module(*prefill[:-1]))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dest", help="the package's data/aot folder (one folder per module)")
    ap.add_argument("--arch", default="9.0a", help="FLASHINFER_CUDA_ARCH_LIST (9.0a: H100, H200)")
    ap.add_argument("--head-dim", type=int, default=64, help="the demo target's and its heads' head size")
    ap.add_argument("--only", default=None, help="build only the modules whose name contains this")
    a = ap.parse_args(argv)
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = a.arch  # read when FlashInfer's JIT is imported
    os.makedirs(a.dest, exist_ok=True)
    for label, spec in module_specs(a.head_dim):
        if a.only and a.only not in spec.name:
            continue
        out = os.path.join(a.dest, spec.name, spec.name + ".so")
        if os.path.exists(out):
            print(f"{label}: {spec.name} already there", flush=True)
            continue
        t = time.time()
        spec.build(verbose=False)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        shutil.copy2(str(spec.jit_library_path), out)
        print(f"{label}: {spec.name} built in {time.time() - t:.0f} s, {os.path.getsize(out) / 1e6:.1f} MB",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
