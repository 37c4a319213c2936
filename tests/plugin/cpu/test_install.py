"""When the stand-ins are used: only on the CPU engine, never over a real ``sgl_kernel``; spawned children see them."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run(code: str, env_extra=None, pythonpath_extra=None, script=None):
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join([p for p in [pythonpath_extra, ROOT, env.get("PYTHONPATH")] if p])
    argv = [sys.executable, script] if script else [sys.executable, "-c", textwrap.dedent(code)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_not_installed_off_the_cpu_engine():
    out = run("""
        import sys
        from treespec_sglang.plugin import cpu
        print(cpu.install(), "sgl_kernel" in sys.modules, cpu.SHIM_DIR in sys.path)
    """)
    assert out == "False False False"


@pytest.fixture
def real_kernel_dir(tmp_path):
    """A directory holding an importable stand-in for a real ``sgl_kernel`` install (``REAL = True``)."""
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    return str(tmp_path)


def test_a_real_sgl_kernel_is_left_alone(real_kernel_dir):
    out = run("""
        import sys, torch
        from treespec_sglang.plugin import cpu
        print(cpu.install(), cpu.should_install(), cpu.active(), cpu.SHIM_DIR in sys.path,
              hasattr(torch.ops.sgl_kernel, "decode_attention_cpu"), __import__("sgl_kernel").REAL)
    """, {"SGLANG_USE_CPU_ENGINE": "1"}, real_kernel_dir)
    assert out == "False False False False False True"


def test_an_imported_real_sgl_kernel_is_left_alone(real_kernel_dir):
    out = run("""
        import sgl_kernel
        from treespec_sglang.plugin import cpu
        print(cpu.install(force=True), __import__("sys").modules["sgl_kernel"].REAL)
    """, {"SGLANG_USE_CPU_ENGINE": "1"}, real_kernel_dir)
    assert out == "False True"


CHILD_SCRIPT = """
import multiprocessing as mp, sys, torch
from treespec_sglang.plugin import cpu


def child(q):
    import sgl_kernel, torch  # resolved through the shim on the sys.path multiprocessing handed over
    q.put((sgl_kernel.__treespec_standin__, all(hasattr(sgl_kernel, n) for n in cpu.OPS),
           hasattr(torch.ops.sgl_kernel, "extend_attention_cpu")))


if __name__ == "__main__":
    ok = cpu.install()
    import sgl_kernel
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    res = q.get(timeout=120)
    p.join()
    print(ok, cpu.active(), sys.path[-1] == cpu.SHIM_DIR, sgl_kernel.verify_tree_greedy_cpu.__module__,
          hasattr(torch.ops.sgl_kernel, "decode_attention_cpu"), res)
"""


def test_installed_on_the_cpu_engine_and_seen_by_spawned_children(tmp_path):
    script = tmp_path / "spawn_check.py"
    script.write_text(CHILD_SCRIPT)
    out = run("", {"SGLANG_USE_CPU_ENGINE": "1"}, script=str(script))
    assert out == "True True True treespec_sglang.plugin.cpu.kernels True (True, True, True)"


@pytest.mark.parametrize("algorithm,passed", [("EAGLE", True), ("EAGLE3", False)])
def test_a_token_map_beside_the_head_is_passed_under_eagle_only(tmp_path, algorithm, passed):
    """An EAGLE-3 head carries its own ``d2t``; SGLang warns about and ignores a ``--speculative-token-map``."""
    from treespec_sglang.plugin.cpu.host import eagle_kwargs

    (tmp_path / "token_map.pt").write_bytes(b"")
    kw = eagle_kwargs(str(tmp_path), algorithm=algorithm)
    assert ("speculative_token_map" in kw) is passed and kw["speculative_algorithm"] == algorithm
