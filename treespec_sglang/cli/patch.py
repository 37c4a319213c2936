"""``treespec patch check|apply|revert``: manage the source patches on the installed sglang."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    p = sub.add_parser("patch", help="check / apply / revert treespec's patches on the installed sglang==0.5.23")
    p.add_argument("action", choices=["check", "apply", "revert"])
    p.add_argument("--site", default=None, help="site-packages directory holding sglang/ (default: the installed one)")
    p.add_argument("--patches", default=None, help="directory of *.patch files (default: the shipped ones)")
    p.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from ..plugin.patching import PatchError, apply_patches, find_sglang, load_patches, patch_status, revert_patches

    try:
        site, version = find_sglang(a.site)
        patches = load_patches(a.patches)
        if a.action == "check":
            rows = [(p.name, patch_status(p, site)) for p in patches]
        elif a.action == "apply":
            rows = apply_patches(patches, site)
        else:
            rows = revert_patches(patches, site)
    except PatchError as e:
        print(f"treespec patch {a.action}: {e}", file=sys.stderr)  # one line on stderr, as every command's errors
        return 2
    print(f"sglang {version} at {site}")
    for name, state in rows:
        print(f"  {name}: {state}")
    return 1 if a.action == "check" and any(s == "conflict" for _, s in rows) else 0
