"""Compile the fused selection and unlink kernels for an H100 (sm_90a) without a GPU, through the plugin's own
launch path (``pool_kernels.launch`` / ``unlink_kernel.launch_unlink``: its argument types, alignment hints,
constexprs and warps), and report ptxas's registers and spills per variant. Run in a subprocess by
``tests/plugin/test_kernel_compile.py`` (it swaps Triton's active driver for one that needs no CUDA):

    python -m tests.plugin.kernel_compile 4,3,8 8,4,32     # one JSON line per launched kernel
"""

import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.driver import CudaDriver  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


class NoDeviceDriver(CudaDriver):
    """Triton's CUDA driver answering for an sm_90 device 0 without libcuda (compilation needs no device)."""

    def __init__(self):
        pass

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


class Compiling:
    """A kernel in ``launch``'s ``kernel[grid](...)`` form that compiles (``warmup``) instead of running."""

    def __init__(self, jit, name, seen):
        self.jit, self.name, self.seen = jit, name, seen

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.seen.append((self.name, kwargs.get("num_warps", 4), self.jit.warmup(*args, grid=grid, **kwargs)))
        return call


def ptxas(ptx: str) -> dict:
    """``{"registers", "spill_bytes"}`` of the PTX by Triton's bundled ptxas (``-v``)."""
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        err = subprocess.run([exe, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", err)]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", err)]
    return {"registers": max(regs), "spill_bytes": max(spills or [0])}


def main(shapes):
    driver.set_active(NoDeviceDriver())
    from treespec_sglang.plugin import pool_kernels as pk, unlink_kernel
    from treespec_sglang.plugin.pool import BatchPlan, PoolView, first_child_parents
    from treespec_sglang.plugin.rows import policy_rows
    from treespec_sglang.policies import parse_spec

    real, seen = pk.kernels(False), []

    class Mod:
        N_WORK, N_WORKF = real.N_WORK, real.N_WORKF
        pool_select_kernel = Compiling(real.pool_select_kernel, "select", seen)
        unlink_kernel = Compiling(real.unlink_kernel, "unlink", seen)

    for k, S, N in shapes:
        bs, P = 2, k + (S - 1) * k * k
        pool = PoolView.from_flat(torch.rand(bs, P) + 0.1, torch.zeros(bs, P, dtype=torch.int64),
                                  torch.tensor([first_child_parents(k, S)] * bs), k)
        params = [parse_spec({"policy": "salf", "budget": N, "th": 0.1}), parse_spec({"policy": "c2t", "budget": N})]
        plan = BatchPlan.of(params, N, S)
        out = (torch.empty(bs, N - 1, dtype=torch.int64), torch.empty(bs, N - 1, dtype=torch.int64),
               torch.empty(bs, N, dtype=torch.bool)) + pk.workspace(real, bs, P, "cpu")
        pk.launch(Mod, pool, policy_rows(params, "cpu").contiguous(), pk.stage_table("cpu"),
                  pk.classifier_table(plan.clf_ids, "cpu"), torch.zeros(bs, N - 1, dtype=torch.int64),
                  torch.zeros(bs, P, dtype=torch.bool), out, pk.graph_args(N, S, P, True))
        links = torch.full((bs, N), -1, dtype=torch.int64)
        unlink_kernel.launch_unlink(Mod, links, links.clone(), torch.zeros(bs, N, dtype=torch.bool),
                                    torch.empty(bs, 1 << max(N - 1, 1).bit_length(), dtype=torch.int64))
        for name, nw, kernel in seen:
            print(json.dumps(dict(kernel=name, k=k, S=S, N=N, num_warps=nw, cubin=bool(kernel.asm.get("cubin")),
                                  **ptxas(kernel.asm["ptx"]))), flush=True)
        seen.clear()


if __name__ == "__main__":
    main([tuple(int(x) for x in a.split(",")) for a in sys.argv[1:]])
