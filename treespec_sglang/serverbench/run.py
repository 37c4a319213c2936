"""Run a matrix: prompts -> chat-templated ids, one server start per server setting, every cell timed.

>>> prompts = load_prompts("humaneval,mtbench", every=10, limit=2)              # doctest: +SKIP
>>> rows = run_matrix(cells, ids, launcher, max_new_tokens=64, out="bench/results/server")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .client import RequestRecord, flush_cache, run_requests
from .matrix import Cell, ServerSetting
from .report import format_table, mark_same_output, plot, summarize

__all__ = ["load_prompts", "encode_prompts", "run_matrix"]


def load_prompts(spec: str, every: int = 1, limit: Optional[int] = None) -> List[Tuple[str, list]]:
    """``"humaneval,mtbench"`` and/or ``.jsonl`` paths -> ``[(id, chat messages)]``.

    A JSONL line is an object with ``"prompt"`` (or ``"text"``: one user message) or ``"messages"`` (a chat),
    and optionally ``"id"``. ``every`` / ``limit`` apply per source.
    """
    from ..data import load_prompt_set

    if every < 1 or (limit is not None and limit < 1):
        raise ValueError(f"--every and --num-prompts must be >= 1, got {every} and {limit}")
    out = []
    for src in [s.strip() for s in spec.split(",") if s.strip()]:
        if src.endswith(".jsonl"):
            rows = _read_jsonl(src)
        else:
            ps = load_prompt_set(src)
            rows = [(f"{src}/{i}", [{"role": "user", "content": p}]) for i, p in zip(ps.ids, ps.prompts)]
        rows = [r for i, r in enumerate(rows) if i % every == 0]
        out += rows[:limit] if limit else rows
    if not out:
        raise ValueError(f"--prompts {spec!r} gave no prompts")
    return out


def _read_jsonl(path: str) -> List[Tuple[str, list]]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: each line must be a JSON object, got {type(obj).__name__}")
            if isinstance(obj.get("messages"), list) and obj["messages"]:
                msgs = obj["messages"]
            elif isinstance(obj.get("prompt", obj.get("text")), str) and obj.get("prompt", obj.get("text")):
                msgs = [{"role": "user", "content": obj.get("prompt", obj.get("text"))}]
            else:
                raise ValueError(f"{path}:{n}: needs a non-empty 'prompt' / 'text' string or a 'messages' list")
            rows.append((str(obj.get("id", f"{os.path.basename(path)}/{n}")), msgs))
    return rows


def encode_prompts(tokenizer, prompts: Sequence[Tuple[str, list]], chat_template: bool = True) -> List[List[int]]:
    """Token ids per prompt: the tokenizer's chat template with the generation prompt, or the raw user text."""
    ids = []
    for _, msgs in prompts:
        if chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            ids.append(list(tokenizer(text, add_special_tokens=False).input_ids))
        else:
            ids.append(tokenizer("\n".join(m["content"] for m in msgs)).input_ids)
    return ids


def run_matrix(cells: Sequence[Cell], prompt_ids: Sequence[Sequence[int]], launcher: Callable[[ServerSetting], object],
               *, max_new_tokens: int, out: str, prompt_names: Sequence[str] = (), ignore_eos: bool = False,
               progress: bool = True, log: Callable[[str], None] = print) -> List[dict]:
    """Run every cell; ``launcher(setting)`` returns a context manager yielding the server URL (a started
    ``LaunchedServer``, or a running server's URL in a ``nullcontext``). Writes ``results.jsonl`` (a row
    per cell), ``requests.jsonl``, ``table.md`` and the plots into ``out``; returns the rows. A server that
    fails to start (or dies) fails its own cells, with the reason; the other servers still run."""
    os.makedirs(out, exist_ok=True)
    rows, outputs = [], {}
    req_file = open(os.path.join(out, "requests.jsonl"), "w")
    try:
        for setting in _ordered_servers(cells):
            mine = [c for c in cells if c.server == setting]
            try:
                _run_server(setting, mine, launcher, prompt_ids, prompt_names, max_new_tokens, ignore_eos, progress,
                            log, rows, outputs, req_file)
            except Exception as e:  # this server's cells fail with the reason; the next server still runs
                msg = f"server {setting.label}: {type(e).__name__}: {e}"
                log(msg)
                done = {r["cell"] for r in rows}
                for cell in mine:
                    if cell.label not in done:
                        rows.append(summarize(cell, [RequestRecord(i, error=msg[:2000]) for i in range(len(prompt_ids))],
                                              0.0))
                        outputs[cell.label] = [None] * len(prompt_ids)
    finally:
        req_file.close()
        if rows:
            mark_same_output(rows, outputs)
            _write(rows, out)
    return rows


def _run_server(setting, mine, launcher, prompt_ids, prompt_names, max_new_tokens, ignore_eos, progress, log, rows,
                outputs, req_file) -> None:
    from tqdm import tqdm

    with launcher(setting) as url:
        log(f"server {setting.label} up at {url}; {len(mine)} cells")
        run_requests(url, prompt_ids[:1], {"max_new_tokens": 4, "temperature": 0.0}, 1)  # warm-up
        for cell in mine:
            err = flush_cache(url)  # every cell pays its prompts' prefill (no radix-cache hits from earlier cells)
            if err:
                log(f"{cell.label}: could not flush the prefix cache ({err}); TTFT may include cache hits")
            sp = {"max_new_tokens": max_new_tokens, "temperature": cell.temperature, "ignore_eos": ignore_eos}
            if cell.spec is not None:
                sp["custom_params"] = {"treespec": cell.spec}
            with (tqdm(total=len(prompt_ids), desc=cell.label, unit="req", leave=False) if progress
                  else nullcontext()) as bar:
                records, wall = run_requests(url, prompt_ids, sp, cell.concurrency,
                                             on_done=(lambda r: bar.update(1)) if bar is not None else None)
            row = summarize(cell, records, wall)
            rows.append(row)
            outputs[cell.label] = [r.output_ids if r.ok else None for r in records]
            for r in records:
                req_file.write(json.dumps(dict(cell=cell.label, index=r.index,
                                               prompt=prompt_names[r.index] if prompt_names else r.index,
                                               ok=r.ok, error=r.error, ttft=r.ttft, latency=r.latency,
                                               itl=r.itl, output_ids=r.output_ids, meta=r.meta)) + "\n")
            log(f"{cell.label}: {row['output_tok_s']:.1f} tok/s, tau {row['tau']:.2f}, "
                f"verified/round {row['verified_per_round']:.1f}, errors {row['errors']}")


def _ordered_servers(cells: Sequence[Cell]) -> List[ServerSetting]:
    seen: Dict[ServerSetting, None] = {}
    for c in cells:
        seen.setdefault(c.server, None)
    return list(seen)


def _write(rows: List[dict], out: str) -> None:
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(format_table(rows) + "\n")
    plot(rows, out)
