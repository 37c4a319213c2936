"""``treespec patch check|apply|revert``: source patches for what hooks cannot reach (no sglang import).

Patches live in the repository's ``patches/`` folder (installed as ``treespec_sglang.patches``), one
unified diff per file, paths relative to site-packages (``a/sglang/srt/...``), each with a header
saying why it exists. The applier is exact (no fuzz; a hunk may move by a few lines), idempotent
(an applied patch is detected by its reverse applying cleanly) and refuses any sglang other than
the pinned version with a clear message.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from importlib import metadata, resources
from typing import List, Optional, Tuple

__all__ = ["Hunk", "FilePatch", "Patch", "PatchError", "load_patches", "parse_patch", "apply_hunks",
           "find_sglang", "patch_status", "apply_patches", "revert_patches", "SGLANG_VERSION"]

SGLANG_VERSION = "0.5.23"
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(RuntimeError):
    pass


@dataclass
class Hunk:
    old_start: int
    old: List[str] = field(default_factory=list)  # context + removed lines
    new: List[str] = field(default_factory=list)  # context + added lines


@dataclass
class FilePatch:
    path: str  # relative to site-packages, e.g. sglang/srt/speculative/eagle_worker_v2.py
    hunks: List[Hunk]


@dataclass
class Patch:
    name: str
    header: str
    files: List[FilePatch]


def parse_patch(name: str, text: str) -> Patch:
    lines = text.splitlines()
    header, files, i = [], [], 0
    while i < len(lines) and not lines[i].startswith("--- "):
        header.append(lines[i])
        i += 1
    cur: Optional[FilePatch] = None
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- "):
            target = lines[i + 1]
            if not target.startswith("+++ "):
                raise PatchError(f"{name}: '+++' expected after '---' at line {i + 1}")
            path = target[4:].split("\t")[0].strip()
            cur = FilePatch(path.split("/", 1)[1] if path.startswith("b/") else path, [])
            files.append(cur)
            i += 2
            continue
        m = _HUNK.match(line)
        if m and cur is not None:
            h = Hunk(int(m.group(1)))
            i += 1
            while i < len(lines) and lines[i][:1] in (" ", "-", "+", "\\") and not lines[i].startswith("--- "):
                tag, body = lines[i][:1], lines[i][1:]
                if tag in (" ", "-"):
                    h.old.append(body)
                if tag in (" ", "+"):
                    h.new.append(body)
                i += 1
            cur.hunks.append(h)
            continue
        i += 1
    if not files:
        raise PatchError(f"{name}: no file diffs found")
    return Patch(name, "\n".join(header).strip(), files)


def apply_hunks(text: str, hunks: List[Hunk], reverse: bool = False, max_offset: int = 50) -> str:
    """Apply (or reverse) hunks exactly; raise :class:`PatchError` if any context does not match."""
    lines = text.split("\n")
    delta = 0
    for h in hunks:
        old, new = (h.new, h.old) if reverse else (h.old, h.new)
        want = h.old_start - 1 + delta
        for off in sorted(range(-max_offset, max_offset + 1), key=abs):
            at = want + off
            if 0 <= at <= len(lines) - len(old) and lines[at:at + len(old)] == old:
                lines[at:at + len(old)] = new
                delta += len(new) - len(old) + off
                break
        else:
            raise PatchError(f"hunk at line {h.old_start} does not match")
    return "\n".join(lines)


def load_patches(directory: Optional[str] = None) -> List[Patch]:
    """Every ``*.patch`` of ``directory`` (default: the installed ``treespec_sglang.patches``)."""
    if directory is None:
        root = resources.files("treespec_sglang.patches")
        items = sorted((p.name, p.read_text()) for p in root.iterdir() if p.name.endswith(".patch"))
    else:
        items = sorted((f, open(os.path.join(directory, f)).read()) for f in os.listdir(directory)
                       if f.endswith(".patch"))
    return [parse_patch(n, t) for n, t in items]


def find_sglang(site: Optional[str] = None) -> Tuple[str, str]:
    """(site-packages directory holding ``sglang/``, installed version); refuses other versions."""
    given = site
    if site is None:
        try:
            dist = metadata.distribution("sglang")
        except metadata.PackageNotFoundError:
            raise PatchError("sglang is not installed: pip install 'treespec-sglang[sglang]' "
                             f"(sglang=={SGLANG_VERSION})") from None
        version = dist.version
        site = str(dist.locate_file(""))
    else:
        version = _version_in(site)
    if version != SGLANG_VERSION:
        raise PatchError(f"treespec patches target sglang=={SGLANG_VERSION}, found sglang=={version} in {site}; "
                         f"install sglang=={SGLANG_VERSION} (the hooks alone need no patch)")
    if not os.path.isdir(os.path.join(site, "sglang")) and given is None:
        site = _package_parent() or site  # an editable install (SGLang's images): the source checkout
    if not os.path.isdir(os.path.join(site, "sglang")):
        raise PatchError(f"no sglang package under {site}")
    return site, version


def _package_parent() -> Optional[str]:
    """The directory holding the ``sglang`` package, found without importing it (None if not found)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    return os.path.dirname(os.path.abspath(locs[0])) if locs else None


def _version_in(site: str) -> str:
    for entry in os.listdir(site):
        m = re.match(r"sglang-([^-]+)\.dist-info$", entry)
        if m:
            return m.group(1)
    raise PatchError(f"no sglang-*.dist-info under {site}")


def patch_status(patch: Patch, site: str) -> str:
    """``applied``, ``not applied`` or ``conflict`` (neither direction matches)."""
    states = set()
    for fp in patch.files:
        text = open(os.path.join(site, fp.path)).read()
        try:
            apply_hunks(text, fp.hunks, reverse=True)
            states.add("applied")
            continue
        except PatchError:
            pass
        try:
            apply_hunks(text, fp.hunks)
            states.add("not applied")
        except PatchError:
            states.add("conflict")
    return states.pop() if len(states) == 1 else "conflict"


def _write_all(patch: Patch, site: str, reverse: bool) -> None:
    new = {}
    for fp in patch.files:  # compute everything first: a failure leaves no file half-patched
        path = os.path.join(site, fp.path)
        new[path] = apply_hunks(open(path).read(), fp.hunks, reverse=reverse)
    for path, text in new.items():
        with open(path, "w") as f:
            f.write(text)


def _move(patches: List[Patch], site: str, reverse: bool) -> List[Tuple[str, str]]:
    """Bring every patch to "applied" (``reverse=False``, in order) or "not applied" (reverse order),
    writing only the patches not there yet; a conflict raises before that patch's files change."""
    todo, done, already = ("applied", "reverted", "not applied") if reverse else \
        ("not applied", "applied", "already applied")
    out = []
    for p in (reversed(patches) if reverse else patches):
        st = patch_status(p, site)
        if st == "conflict":
            raise PatchError(f"{p.name}: cannot be reverted cleanly in {site}" if reverse else
                             f"{p.name}: does not apply to {site} (files changed by hand or another tool)")
        if st == todo:
            _write_all(p, site, reverse=reverse)
        out.append((p.name, done if st == todo else already))
    return out


def apply_patches(patches: List[Patch], site: str) -> List[Tuple[str, str]]:
    """Apply each patch not yet applied (idempotent) -> [(name, "applied" | "already applied")]."""
    return _move(patches, site, reverse=False)


def revert_patches(patches: List[Patch], site: str) -> List[Tuple[str, str]]:
    """Revert each applied patch, last first -> [(name, "reverted" | "not applied")]."""
    return _move(patches, site, reverse=True)
