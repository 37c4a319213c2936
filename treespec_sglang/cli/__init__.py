"""The ``treespec`` command line (``python -m treespec_sglang`` too).

``demo`` (the main job), ``bench`` (whole prompt sets, JSONL + plots), ``bench-server`` (the policy
matrix against real SGLang servers), ``policies`` (every
registered tree policy with its parameters and defaults), ``patch`` (sglang source patches) and
``train data|draft`` (self-distillation data, draft-head training).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

__all__ = ["main", "build_parser"]


def _policies(args) -> int:
    from treespec_sglang.policies import POLICIES

    rows = {}
    for name, cls in sorted(POLICIES.items()):
        rows[name] = {f.name: f.default for f in dataclasses.fields(cls.Params)}
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        for name, params in rows.items():
            doc = POLICIES[name].Params.__doc__ or ""
            print(f"{name:7s} {', '.join(f'{k}={v!r}' for k, v in params.items())}")
            print(f"        {doc.strip().splitlines()[0]}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its usage errors on one line, as every other bad input (``main``): exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``treespec`` parser with every subcommand (``main`` parses with it; tests walk it)."""
    ap = _Parser(prog="treespec", description="treespec-sglang: per-request draft-tree policies")
    ap.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("policies", help="list the tree policies, their parameters and defaults")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_policies)
    from . import bench, bench_server, demo, patch, train

    demo.add_parser(sub)
    bench.add_parser(sub)
    bench_server.add_parser(sub)
    patch.add_parser(sub)
    train.add_parser(sub)
    return ap


def main(argv=None) -> int:
    """Run a subcommand. Bad input (a missing path, bad JSON, an out-of-range value) is one line on stderr
    and exit code 2; ``--debug`` (or ``TREESPEC_DEBUG=1``) shows the traceback instead. Informational
    lines (the dtype chosen, budgets) go to stdout."""
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, OSError, ImportError) as e:  # JSONDecodeError is a ValueError
        if args.debug or os.environ.get("TREESPEC_DEBUG", "").strip() not in ("", "0"):
            raise
        kind = "" if type(e) is ValueError else f"{type(e).__name__}: "
        print(f"treespec {args.cmd}: {kind}{e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
