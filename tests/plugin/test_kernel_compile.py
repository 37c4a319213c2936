"""The fused kernels as an H100 gets them: compiled for sm_90a through the plugin's own launch path (no GPU: a
driver stand-in answers for the device; ``tests/plugin/kernel_compile.py``), every variant a cubin, no register
spills at the shapes SGLang serves (topk <= 8). The interpreter runs the same source in the other tests; only
this checks what the compiler makes of it."""

import json
import os
import subprocess
import sys

import pytest

from treespec_sglang.plugin.pool_kernels import warps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (topk, steps, draft tokens): pools of 6 / 36 / 200 / 264 candidates -> blocks of 16 / 64 / 256 / 512 lanes
SHAPES = [(2, 3, 6), (4, 3, 8), (8, 4, 32), (8, 5, 64)]


def test_a_row_program_has_a_thread_per_pool_lane_up_to_8_warps():
    assert [warps(b) for b in (1, 16, 32, 64, 128, 256, 512, 1024)] == [1, 1, 1, 2, 4, 8, 8, 8]


def test_every_launched_variant_compiles_for_an_h100_without_spilling():
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    shapes = [",".join(map(str, s)) for s in SHAPES]
    run = subprocess.run([sys.executable, "-m", "tests.plugin.kernel_compile"] + shapes, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["kernel"], r["k"], r["S"], r["N"]) for r in rows) == sorted(
        (name, *s) for s in SHAPES for name in ("select", "unlink"))
    for r in rows:
        assert r["cubin"] and r["spill_bytes"] == 0 and r["registers"] <= 255, r
