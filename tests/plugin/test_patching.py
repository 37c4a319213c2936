"""The patch tool: exact, idempotent apply/revert; version refusal; on a synthetic site and (sglang
marker) on the real installed sglang files."""

import hashlib
import os
import py_compile

import pytest

from treespec_sglang.cli import main
from treespec_sglang.plugin.patching import (PatchError, apply_hunks, apply_patches, find_sglang, load_patches,
                                             parse_patch, patch_status, revert_patches)

DIFF = """why: a header line
--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -3,3 +3,4 @@
 c
-d
+D
+D2
 e
"""


def test_apply_hunks_exact_with_offset_and_reverse():
    p = parse_patch("x", DIFF)
    assert p.header == "why: a header line" and p.files[0].path == "pkg/mod.py"
    text = "a\nb\nc\nd\ne\nf"
    new = apply_hunks(text, p.files[0].hunks)
    assert new == "a\nb\nc\nD\nD2\ne\nf"
    assert apply_hunks(new, p.files[0].hunks, reverse=True) == text
    shifted = "z\nz\n" + text  # the hunk moved by two lines
    assert apply_hunks(shifted, p.files[0].hunks) == "z\nz\n" + new
    with pytest.raises(PatchError, match="does not match"):
        apply_hunks("a\nb\nc\nX\ne", p.files[0].hunks)


def fake_site(tmp_path, version, patches):
    """A site-packages with sglang-<version>.dist-info and the pre-patch text of every patched file."""
    site = tmp_path / "site"
    (site / f"sglang-{version}.dist-info").mkdir(parents=True)
    for p in patches:
        for fp in p.files:
            path = site / fp.path
            path.parent.mkdir(parents=True, exist_ok=True)
            body = []
            for h in fp.hunks:
                body += ["# filler"] * max(0, h.old_start - 1 - len(body)) + h.old
            path.write_text("\n".join(body + ["# end"]))
    (site / "sglang").mkdir(exist_ok=True)
    return str(site)


def digest(site, patches):
    return {fp.path: hashlib.sha256(open(os.path.join(site, fp.path), "rb").read()).hexdigest()
            for p in patches for fp in p.files}


def test_shipped_patches_roundtrip_on_a_synthetic_site(tmp_path, capsys):
    patches = load_patches()
    assert patches and all(p.header for p in patches)  # every patch says why it exists
    site = fake_site(tmp_path, "0.5.23", patches)
    before = digest(site, patches)
    assert all(patch_status(p, site) == "not applied" for p in patches)
    assert main(["patch", "apply", "--site", site]) == 0
    assert all(patch_status(p, site) == "applied" for p in patches)
    assert [s for _, s in apply_patches(patches, site)] == ["already applied"] * len(patches)  # idempotent
    assert main(["patch", "check", "--site", site]) == 0
    assert main(["patch", "revert", "--site", site]) == 0
    assert digest(site, patches) == before
    assert "reverted" in capsys.readouterr().out


def test_other_versions_are_refused(tmp_path, capsys):
    site = fake_site(tmp_path, "0.5.22", load_patches())
    with pytest.raises(PatchError, match=r"target sglang==0.5.23, found sglang==0.5.22"):
        find_sglang(site)
    assert main(["patch", "apply", "--site", site]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "found sglang==0.5.22" in out.err  # one line, on stderr


@pytest.mark.sglang
def test_patches_apply_and_revert_on_the_installed_sglang():
    pytest.importorskip("sglang")
    site, version = find_sglang()
    patches = load_patches()
    before = digest(site, patches)
    assert all(patch_status(p, site) == "not applied" for p in patches)
    try:
        apply_patches(patches, site)
        assert all(patch_status(p, site) == "applied" for p in patches)
        for p in patches:
            for fp in p.files:
                py_compile.compile(os.path.join(site, fp.path), doraise=True)
    finally:
        revert_patches(patches, site)
    assert digest(site, patches) == before


def test_an_editable_sglang_is_found_in_its_source_checkout(tmp_path, monkeypatch):
    """SGLang's Docker images install sglang editable: the dist-info sits in site-packages, the package in
    the checkout (``/sgl-workspace/sglang/python/sglang``); the patches must go to the checkout."""
    import importlib.machinery
    import importlib.util
    from importlib import metadata

    from treespec_sglang.plugin import patching

    site, checkout = tmp_path / "site-packages", tmp_path / "checkout" / "python"
    (site / "sglang-0.5.23.dist-info").mkdir(parents=True)
    (checkout / "sglang").mkdir(parents=True)

    class Dist:
        version = "0.5.23"

        def locate_file(self, rel):
            return site / rel

    monkeypatch.setattr(metadata, "distribution", lambda name: Dist())
    spec = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
    spec.submodule_search_locations = [str(checkout / "sglang")]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "sglang" else real(name, *a))
    assert patching.find_sglang() == (str(checkout), "0.5.23")
    with pytest.raises(PatchError, match="no sglang package under"):  # an explicit --site is taken as given
        patching.find_sglang(str(site))


@pytest.mark.parametrize("spec", [None, "a module, not a package"])
def test_no_sglang_package_found_is_none(monkeypatch, spec):
    import importlib.machinery
    import importlib.util

    from treespec_sglang.plugin import patching

    found = None if spec is None else importlib.machinery.ModuleSpec("sglang", None)  # no search locations
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: found)
    assert patching._package_parent() is None


def test_a_site_without_sglangs_dist_info_is_named(tmp_path):
    (tmp_path / "sglang").mkdir()
    with pytest.raises(PatchError, match=f"^no sglang-\\*\\.dist-info under {tmp_path}$"):
        find_sglang(str(tmp_path))


GIT_DIFF = """From: someone
Subject: two files

diff --git a/pkg/one.py b/pkg/one.py
index 1111111..2222222 100644
--- a/pkg/one.py
+++ b/pkg/one.py
@@ -1,2 +1,2 @@
 keep
-old
+new
@@ -9 +9,2 @@ def f():
 nine
+ten
diff --git a/pkg/two.py b/pkg/two.py
--- a/pkg/two.py\t2026-01-01
+++ b/pkg/two.py\t2026-01-02
@@ -4 +4 @@
-last
\\ No newline at end of file
+last!
\\ No newline at end of file
"""


def test_a_git_patch_parses_into_its_files_and_hunks_line_by_line():
    """git's extra lines between files are skipped; a hunk's ``\\ No newline`` markers are read past; every hunk
    keeps its context, removed and added lines in order."""
    from treespec_sglang.plugin.patching import Hunk

    p = parse_patch("two.patch", GIT_DIFF)
    assert p.name == "two.patch" and p.header == "From: someone\nSubject: two files\n\ndiff --git a/pkg/one.py b/pkg/one.py\nindex 1111111..2222222 100644"
    assert [f.path for f in p.files] == ["pkg/one.py", "pkg/two.py"]
    assert p.files[0].hunks == [Hunk(1, ["keep", "old"], ["keep", "new"]), Hunk(9, ["nine"], ["nine", "ten"])]
    assert p.files[1].hunks == [Hunk(4, ["last"], ["last!"])]


def test_a_patch_without_file_diffs_or_a_target_is_refused():
    with pytest.raises(PatchError, match="^x.patch: no file diffs found$"):
        parse_patch("x.patch", "just a note\n")
    with pytest.raises(PatchError, match=r"^x.patch: '\+\+\+' expected after '---' at line 2$"):
        parse_patch("x.patch", "note\n--- a/f\nnot a target\n")


def test_sglang_not_installed_says_how_to_install_it(monkeypatch):
    from importlib import metadata

    from treespec_sglang.plugin import patching

    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(PatchError, match=r"^sglang is not installed: pip install 'treespec-sglang\[sglang\]' "
                                         r"\(sglang==0\.5\.23\)$"):
        patching.find_sglang()


def test_an_installed_sglang_is_found_in_its_own_site(tmp_path, monkeypatch):
    from importlib import metadata

    from treespec_sglang.plugin import patching

    (tmp_path / "sglang").mkdir()

    class Dist:
        version = "0.5.23"

        def locate_file(self, rel):
            return tmp_path / rel if rel == "" else tmp_path / "elsewhere"
    monkeypatch.setattr(metadata, "distribution", lambda name: Dist() if name == "sglang" else None)
    monkeypatch.setattr(patching, "_package_parent", lambda: "not this one")
    assert patching.find_sglang() == (str(tmp_path), "0.5.23")


# ---------------------------------------------------------------------------- the patch tool on synthetic files
def hunk(start, old, new):
    from treespec_sglang.plugin.patching import Hunk

    return Hunk(start, list(old), list(new))


@pytest.mark.parametrize("lines, start, want", [
    (["x", "a", "b"], 2, ["x", "A", "b"]),  # at the hunk's own line
    (["a", "b", "x"], 2, ["A", "b", "x"]),  # the file's first line (one line early)
    (["x", "x", "a", "b"], 2, ["x", "x", "A", "b"]),  # the file's last lines (one line late)
    (["a", "b", "x", "a", "b"], 2, ["A", "b", "x", "a", "b"]),  # one early and two late: the nearer
    (["a", "b", "x", "a", "b"], 3, ["a", "b", "x", "A", "b"]),  # two early and one late: the nearer
    (["x", "x", "a", "b", "a", "b"], 4, ["x", "x", "A", "b", "a", "b"]),  # one early and one late: the earlier
])
def test_a_hunk_applies_at_the_nearest_offset(lines, start, want):
    assert apply_hunks("\n".join(lines), [hunk(start, ["a", "b"], ["A", "b"])]).split("\n") == want


def test_a_hunk_is_found_up_to_max_offset_lines_away():
    text = "\n".join(["x"] * 50 + ["a"])
    assert apply_hunks(text, [hunk(1, ["a"], ["A"])]).endswith("\nA")  # 50 lines late
    with pytest.raises(PatchError, match="^hunk at line 1 does not match$"):
        apply_hunks("x\n" + text, [hunk(1, ["a"], ["A"])])  # 51
    with pytest.raises(PatchError):
        apply_hunks("x\na", [hunk(1, ["a"], ["A"])], max_offset=0)


def test_later_hunks_move_by_what_earlier_ones_added_and_where_they_were_found():
    """Hunk 1 (written for line 1) sits one line late and adds two lines: hunk 2 (written for line 3) is then
    exactly three lines late, which max_offset=1 only allows if that shift is carried."""
    text = "\n".join(["x", "a", "y", "b", "z", "c"])
    hunks = [hunk(1, ["a"], ["a", "1", "2"]), hunk(3, ["b"], ["B"]), hunk(5, ["c"], ["C"])]  # hunk 3: still 3 late
    got = apply_hunks(text, hunks, max_offset=1)
    assert got.split("\n") == ["x", "a", "1", "2", "y", "B", "z", "C"]
    assert apply_hunks(got, hunks, reverse=True) == text


PATCH_A = """why: A
--- a/pkg/a.py
+++ b/pkg/a.py
@@ -2 +2 @@
-old a
+new a
--- a/pkg/b.py
+++ b/pkg/b.py
@@ -1 +1 @@
-old b
+new b
"""
PATCH_B = """why: B
--- a/pkg/c.py
+++ b/pkg/c.py
@@ -2 +2 @@
-old c
+new c
"""


@pytest.fixture
def two_patches(tmp_path):
    """A patch directory (two patches and a note) and a site holding their files unpatched."""
    d = tmp_path / "patches"
    d.mkdir()
    (d / "0002-b.patch").write_text(PATCH_B)
    (d / "0001-a.patch").write_text(PATCH_A)
    (d / "README.md").write_text("not a patch")
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    for name, text in (("a.py", "x\nold a\n"), ("b.py", "old b\ny"), ("c.py", "x\nold c\n")):
        (site / "pkg" / name).write_text(text)
    return load_patches(str(d)), str(site)


def test_patches_load_in_name_order_and_move_in_order_then_back_in_reverse(two_patches):
    patches, site = two_patches
    assert [p.name for p in patches] == ["0001-a.patch", "0002-b.patch"] and patches[1].header == "why: B"
    assert apply_patches(patches, site) == [("0001-a.patch", "applied"), ("0002-b.patch", "applied")]
    assert open(os.path.join(site, "pkg", "b.py")).read() == "new b\ny"
    assert apply_patches(patches, site) == [("0001-a.patch", "already applied"), ("0002-b.patch", "already applied")]
    assert revert_patches(patches, site) == [("0002-b.patch", "reverted"), ("0001-a.patch", "reverted")]
    assert open(os.path.join(site, "pkg", "a.py")).read() == "x\nold a\n"
    assert revert_patches(patches, site) == [("0002-b.patch", "not applied"), ("0001-a.patch", "not applied")]


def test_a_patch_half_applied_or_edited_by_hand_is_a_conflict_and_never_written(two_patches):
    patches, site = two_patches
    a = os.path.join(site, "pkg", "a.py")
    open(a, "w").write("x\nnew a\n")  # one of patch A's two files applied
    assert patch_status(patches[0], site) == "conflict" and patch_status(patches[1], site) == "not applied"
    with pytest.raises(PatchError, match=f"^0001-a.patch: does not apply to {site} \\(files changed by hand"):
        apply_patches(patches, site)
    assert open(os.path.join(site, "pkg", "b.py")).read() == "old b\ny"  # nothing written
    open(os.path.join(site, "pkg", "c.py"), "w").write("x\nedited\n")
    assert patch_status(patches[1], site) == "conflict"  # its one file matches neither way
    open(os.path.join(site, "pkg", "c.py"), "w").write("x\nold c\n")
    open(a, "w").write("x\nedited\n")
    apply_patches(patches[1:], site)
    assert patch_status(patches[0], site) == "conflict"
    with pytest.raises(PatchError, match=f"^0001-a.patch: cannot be reverted cleanly in {site}$"):
        revert_patches(patches, site)


def test_target_paths_keep_spaces_and_lose_only_a_b_prefix():
    p = parse_patch("x", "--- a/my file.py\t2026-01-01\n+++ b/my file.py\t2026-01-02\n@@ -1 +1 @@\n-a\n+b\n"
                         "--- pkg/plain.py\n+++ pkg/plain.py\n@@ -1 +1 @@\n-a\n+b\n")
    assert [f.path for f in p.files] == ["my file.py", "pkg/plain.py"]
