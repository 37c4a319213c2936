"""``bench/gpu_flashinfer.sh install``: the GPU-machine side of carrying FlashInfer in pieces, one call each. A piece
is staged in the call that carries it; the package is unpacked only once every piece is there and they make the
packed archive (sha256); a later call finds it installed. The pieces here are a small stand-in package packed the
way ``pack`` packs the real one (``pack`` itself needs PyPI and nvcc: run by hand before a GPU session)."""

import hashlib
import io
import lzma
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu_flashinfer.sh")

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="a bash script")


def packed(init: bytes = b"__version__ = '0.7.2'\n") -> bytes:
    """A stand-in FlashInfer (a version, one module compiled ahead) as ``pack`` writes it: a tar.xz."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("flashinfer/__init__.py", init),
                           ("flashinfer/data/aot/m/m.so", b"\0" * 4096),
                           ("flashinfer_python-0.7.2.dist-info/METADATA", b"Name: flashinfer-python\n")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return lzma.compress(buf.getvalue())


def carry(call_dir, pieces, sha, n):
    """The checkout of one call: ``gpu/fiK`` for each piece K it carries (fi1 also holds the sha and the count)."""
    for k, data in pieces.items():
        d = call_dir / "gpu" / f"fi{k}"
        d.mkdir(parents=True)
        (d / f"fi.tar.xz.part{k - 1:02d}").write_bytes(data)
        if k == 1:
            (d / "fi.tar.xz.sha256").write_text(sha + "\n")
            (d / "pieces").write_text(f"{n}\n")


def install(call_dir, site, stage):
    env = dict(os.environ, SITE=str(site), STAGE=str(stage), PYTHONPATH="")
    return subprocess.run(["bash", SCRIPT, "install"], cwd=call_dir, env=env, capture_output=True, text=True)


def test_pieces_carried_in_two_calls_install_once(tmp_path):
    data = packed()
    half = len(data) // 2
    sha = hashlib.sha256(data).hexdigest()
    site, stage = tmp_path / "site", tmp_path / "stage"
    carry(tmp_path / "call1", {1: data[:half]}, sha, 2)
    first = install(tmp_path / "call1", site, stage)
    assert first.returncode == 2 and "waiting for the pieces: 1 of 2 staged" in first.stdout, first
    assert not (site / "flashinfer").exists()
    carry(tmp_path / "call2", {2: data[half:]}, sha, 2)
    second = install(tmp_path / "call2", site, stage)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "installed 0.7.2 with 1 modules compiled ahead" in second.stdout
    assert (site / "flashinfer" / "data" / "aot" / "m" / "m.so").read_bytes() == b"\0" * 4096
    assert not (stage / "fi.tar.xz").exists()  # the joined archive is not kept beside the pieces
    (tmp_path / "call3").mkdir()
    third = install(tmp_path / "call3", site, stage)
    assert third.returncode == 0 and "already installed" in third.stdout


def test_pieces_that_do_not_make_the_archive_are_refused(tmp_path):
    data = packed()
    half = len(data) // 2
    site, stage = tmp_path / "site", tmp_path / "stage"
    carry(tmp_path / "call", {1: data[:half], 2: data[half + 1:]}, hashlib.sha256(data).hexdigest(), 2)  # a byte lost
    done = install(tmp_path / "call", site, stage)
    assert done.returncode == 1 and "do not make the packed archive" in done.stdout
    assert not (site / "flashinfer").exists()


def test_a_package_that_does_not_import_is_not_marked_installed(tmp_path):
    """A dependency missing there fails the install loudly, and the next call tries again (not "already installed")."""
    data = packed(init=b"import a_module_the_gpu_image_lacks\n")
    site, stage = tmp_path / "site", tmp_path / "stage"
    carry(tmp_path / "call", {1: data}, hashlib.sha256(data).hexdigest(), 1)
    done = install(tmp_path / "call", site, stage)
    assert done.returncode != 0 and "a_module_the_gpu_image_lacks" in done.stderr
    assert not (site / "flashinfer" / ".treespec-installed").exists()
    again = install(tmp_path / "call", site, stage)
    assert again.returncode != 0 and "already installed" not in again.stdout


def test_a_command_is_required():
    done = subprocess.run(["bash", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 2 and "usage: bash bench/gpu_flashinfer.sh pack|install" in done.stderr
