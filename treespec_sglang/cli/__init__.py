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
import sys

__all__ = ["main"]


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="treespec", description="treespec-sglang: per-request draft-tree policies")
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
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
