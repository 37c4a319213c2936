"""``treespec bench-server``: the policy matrix against real SGLang servers (started here, one per server
setting), or against one running server (``--url``). Writes ``results.jsonl`` (a row per cell),
``requests.jsonl``, ``table.md``, ``policies_vs_concurrency.png`` and ``accept_hist.png``.

    treespec bench-server --servers plain,eagle:4/3/8 --policies talon,c2t --budgets N --concurrency 1,4
    treespec bench-server --url http://127.0.0.1:30000 --prompts my_prompts.jsonl --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from contextlib import nullcontext

from .runs import int_at_least

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("bench-server", help="benchmark policies x budgets x concurrency x T against SGLang servers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (its own setting; no restarts, no plain row)")
    p.add_argument("--model", default="demo", help="target model path, or 'demo' (the SmolLM2 demo target)")
    p.add_argument("--draft", default="demo", help="EAGLE / EAGLE-3 draft path (the server's --speculative-algorithm follows its architecture), "
                        "'demo' or 'demo-eagle3' (the shipped heads)")
    p.add_argument("--token-map", default="auto", help="'auto': <draft>/token_map.pt if present; 'none'; a path")
    p.add_argument("--tokenizer", default=None, help="default: the model path (or the server's)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--servers", default=None,
                   help="comma list of 'plain' / 'eagle:TOPK/STEPS/N' (default: plain,eagle:10/6/60 on GPU, "
                        "plain,eagle:4/3/8 on CPU)")
    p.add_argument("--policies", default="eagle2,talon,salf,c2t,chain")
    p.add_argument("--policy-json", default=None,
                   help='per-policy overrides as JSON, e.g. \'{"talon": {"mu": 0.05}, "salf": {"th": 0.6}}\'')
    p.add_argument("--budgets", default="N", help="comma list of integers or N (the server's num-draft-tokens)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--temperatures", default="0")
    p.add_argument("--prompts", default="humaneval,mtbench", help="prompt sets and/or .jsonl files, comma list")
    p.add_argument("--num-prompts", type=int_at_least(1), default=None, help="first N prompts of each source")
    p.add_argument("--every", type=int_at_least(1), default=1, help="every k-th prompt (10: the held-out split)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    p.add_argument("--no-chat-template", action="store_true", help="send the raw user text")
    p.add_argument("--server-args", default="", help="extra launch_server arguments (one string)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--out", default="bench/results/server")
    p.set_defaults(fn=run)


def _paths(a):
    model = a.model
    if model == "demo":
        from ..models.demo import demo_target

        model = demo_target()
    draft = a.draft
    if draft in ("demo", "demo-eagle3"):
        from ..engine.runs import draft_dir_of

        draft = draft_dir_of(draft)
    tmap = a.token_map
    if tmap == "auto":
        cand = os.path.join(draft, "token_map.pt") if draft else ""
        tmap = cand if cand and os.path.isfile(cand) else None
    elif tmap == "none":
        tmap = None
    return model, draft, tmap


def _number(kind, raw: str, flag: str, lo):
    """One entry of a comma list flag as ``kind`` (>= ``lo``), or a ValueError naming the flag."""
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not value >= lo:
        raise ValueError(f"{flag} entries must be {'integers' if kind is int else 'numbers'} >= {lo}, got {raw!r}")
    return value


def run(a: argparse.Namespace) -> int:
    import json

    from transformers import AutoTokenizer

    from ..serverbench import build_matrix, encode_prompts, load_prompts, parse_servers, run_matrix
    from ..serverbench.matrix import POLICY_NAMES, parse_list
    from ..serverbench.server import (LaunchedServer, free_port, get_json, launch_command, setting_of,
                                      stopped_by_signals)

    # bad input raises ValueError / OSError: cli.main prints it as one line with exit code 2
    extra = json.loads(a.policy_json) if a.policy_json else None
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"--policy-json must be a JSON object keyed by policy name, got {a.policy_json!r}")
    for name, over in (extra or {}).items():  # its values are the server's to judge (a bad one fails its row)
        if name not in POLICY_NAMES:
            raise ValueError(f"--policy-json keys must be policy names {list(POLICY_NAMES)}, got {name!r}")
        if not isinstance(over, dict):
            raise ValueError(f"--policy-json[{name!r}] must be a JSON object of that policy's parameters, got "
                             f"{json.dumps(over)}")
    concurrency = [_number(int, x, "--concurrency", 1) for x in parse_list(a.concurrency, "--concurrency")]
    temps = [_number(float, x, "--temperatures", 0.0) for x in parse_list(a.temperatures, "--temperatures")]
    policies = parse_list(a.policies, "--policies") if a.policies.strip() else []
    budgets = parse_list(a.budgets, "--budgets")
    if a.url:
        info = get_json(a.url.rstrip("/") + "/get_server_info")
        servers = [setting_of(info)]
        tok_path = a.tokenizer or info.get("tokenizer_path") or info.get("model_path")
        launcher = lambda s: nullcontext(a.url.rstrip("/"))  # noqa: E731
        print(f"running server {a.url}: {servers[0].label} (no plain row: it would need a restart)")
    else:
        import torch

        device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        servers = parse_servers(a.servers or ("plain,eagle:10/6/60" if device == "cuda" else "plain,eagle:4/3/8"))
        model, draft, tmap = _paths(a)
        tok_path = a.tokenizer or model
        logs = os.path.join(a.out, "logs")
        os.makedirs(logs, exist_ok=True)

        def launcher(setting):
            argv = launch_command(model, setting, draft=draft, token_map=tmap, device=device, port=free_port(),
                                  extra=shlex.split(a.server_args))
            return LaunchedServer(argv, os.path.join(logs, f"{setting.label}.log"), device=device,
                                  startup_timeout=a.startup_timeout)
    cells = build_matrix(servers, policies, budgets, concurrency, temps, extra)
    prompts = load_prompts(a.prompts, every=a.every, limit=a.num_prompts)
    tokenizer = AutoTokenizer.from_pretrained(tok_path)
    ids = encode_prompts(tokenizer, prompts, chat_template=not a.no_chat_template)
    print(f"{len(cells)} cells over {len(servers)} server setting(s), {len(ids)} prompts each")
    t0 = time.time()
    with stopped_by_signals():  # SIGTERM / SIGHUP stop the launched servers too
        rows = run_matrix(cells, ids, launcher, max_new_tokens=a.max_new_tokens, out=a.out,
                          prompt_names=[p[0] for p in prompts], ignore_eos=a.ignore_eos)
    with open(os.path.join(a.out, "table.md")) as f:
        print("\n" + f.read())
    print(f"{time.time() - t0:.0f} s; wrote {a.out}/results.jsonl, requests.jsonl, table.md, "
          f"policies_vs_concurrency.png, accept_hist.png")
    failed = sum(r["errors"] for r in rows)
    if failed:
        print(f"{failed} request(s) failed; see error_examples in results.jsonl", file=sys.stderr)
    return 1 if failed else 0
