"""Streamed ``/generate`` requests at a fixed concurrency, timed per chunk (TTFT, inter-chunk latency).

Each request streams (``"stream": true``): SGLang sends a chunk per scheduler step carrying the text so far
and ``meta_info`` (``completion_tokens``, ``spec_verify_ct``, ... and, with the plugin, the
``treespec_*`` lists of the rounds run so far), so the last chunk has everything a whole response has.
A failed request (HTTP error, abort, timeout) is recorded with its message; the cell goes on.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

__all__ = ["RequestRecord", "stream_generate", "run_requests", "flush_cache"]

META_KEYS = ("completion_tokens", "prompt_tokens", "spec_verify_ct", "spec_num_correct_drafts", "finish_reason",
             "treespec_policy", "treespec_tree_sizes", "treespec_verify_tokens", "treespec_accept_lengths")


@dataclass
class RequestRecord:
    """One request's timings (seconds from its send) and final meta_info."""

    index: int
    ok: bool = False
    error: Optional[str] = None
    ttft: Optional[float] = None  # first chunk with >= 1 output token
    latency: Optional[float] = None  # last chunk
    chunk_times: List[float] = field(default_factory=list)  # each chunk that brought new tokens
    chunk_tokens: List[int] = field(default_factory=list)  # completion tokens so far at that chunk
    output_ids: List[int] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def itl(self) -> List[float]:
        """Gaps between successive token-bearing chunks (a chunk may bring several tokens: one round)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def completion_tokens(self) -> int:
        return int(self.meta.get("completion_tokens") or 0)


def stream_generate(url: str, index: int, input_ids: Sequence[int], sampling_params: dict,
                    timeout: float = 600) -> RequestRecord:
    rec = RequestRecord(index)
    body = json.dumps({"input_ids": list(input_ids), "sampling_params": sampling_params, "stream": True}).encode()
    req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    last = None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter() - t0
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"]))
                n = int(chunk.get("meta_info", {}).get("completion_tokens") or 0)
                if n > (rec.chunk_tokens[-1] if rec.chunk_tokens else 0):
                    rec.chunk_times.append(now)
                    rec.chunk_tokens.append(n)
                last = chunk
    except urllib.error.HTTPError as e:
        rec.error = f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}"
        return rec
    except Exception as e:  # connection reset, timeout, bad chunk: this request fails, the cell goes on
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    if last is None:
        rec.error = "the stream ended without a chunk"
        return rec
    meta = last.get("meta_info", {})
    rec.meta = {k: meta[k] for k in META_KEYS if k in meta}
    rec.output_ids = list(last.get("output_ids") or [])
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        rec.error = f"aborted: {finish.get('message')}"
        return rec
    rec.ok = True
    rec.ttft = rec.chunk_times[0] if rec.chunk_times else None
    rec.latency = rec.chunk_times[-1] if rec.chunk_times else None
    return rec


def run_requests(url: str, prompts: Sequence[Sequence[int]], sampling_params: dict, concurrency: int,
                 on_done: Optional[Callable[[RequestRecord], None]] = None, timeout: float = 600):
    """Send every prompt, at most ``concurrency`` in flight; returns (records in prompt order, wall seconds)."""
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        futures = [pool.submit(stream_generate, url, i, ids, sampling_params, timeout) for i, ids in enumerate(prompts)]
        records = []
        for f in as_completed(futures):
            records.append(f.result())
            if on_done is not None:
                on_done(records[-1])
    except BaseException:  # Ctrl-C, a signal, on_done raising: the queued requests are dropped, not sent first
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return sorted(records, key=lambda r: r.index), time.perf_counter() - t0


def flush_cache(url: str, timeout: float = 60) -> Optional[str]:
    """Empty the server's radix (prefix) cache, so that a cell's TTFT includes its prompts' prefill
    (otherwise every cell after the first would find them cached). Returns an error message or None."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/flush_cache?timeout=30", b"", method="POST"),
                                    timeout=timeout):
            return None
    except Exception as e:  # an older server, an auth-protected admin route: measure anyway, say so
        return f"{type(e).__name__}: {e}"
