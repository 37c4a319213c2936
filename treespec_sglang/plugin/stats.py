"""Per-request ``treespec_*`` stats on streamed responses (hook body; imports nothing of sglang).

SGLang 0.5.23 sends a request-level ``customized_info`` key of a *streamed* request with its first
chunk only (``_GenerationStreamAccumulator.accept``: ``if req.stream and send_token_offset != 0:
continue``), before any verify round has run, so a stream never saw our per-round lists. The
tokenizer manager, on the other hand, *extends* a key's accumulated list with every chunk's values
(``_accumulate_request_meta_info``). So for a streamed request this hook sends each chunk the rounds
recorded since the previous chunk (the delta), and the client's last chunk carries the whole list,
exactly what a non-streamed response carries.

Worked example: rounds recorded 3, 1 | 4, 2, 2 | 5 across three chunks -> the chunks carry
``[3, 1]``, ``[4, 2, 2]``, ``[5]``; the tokenizer manager accumulates ``[3, 1, 4, 2, 2, 5]``.
Non-streamed requests are left to SGLang (request-level keys go out once, when the request finishes).
"""

from __future__ import annotations

__all__ = ["PREFIX", "stream_accept"]

PREFIX = "treespec_"
_SENT = "_treespec_sent"  # on the Req: {key: how many values earlier chunks carried}


def stream_accept(original, self, *args, **kwargs):
    """AROUND ``_GenerationStreamAccumulator.accept(self, *, req)``."""
    req = kwargs.get("req", args[0] if args else None)
    info = getattr(req, "customized_info", None)
    if not getattr(req, "stream", False) or not info or not any(str(k).startswith(PREFIX) for k in info):
        return original(self, *args, **kwargs)
    ours = {k: info.pop(k) for k in list(info) if str(k).startswith(PREFIX)}
    n_before = len(self.rids)
    try:
        out = original(self, *args, **kwargs)
    finally:
        info.update(ours)
    if len(self.rids) == n_before:  # this step emits no chunk for the request: send later
        return out
    sent = getattr(req, _SENT, None)
    if sent is None:
        sent = {}
        setattr(req, _SENT, sent)
    row = len(self.rids) - 1  # the chunk the original just appended for this request
    for key, values in ours.items():
        values = list(values or [])
        delta = values[min(sent.get(key, 0), len(values)):]  # treespec_policy (one value) goes once
        column = self.customized_info.setdefault(key, [[] for _ in range(row)])
        while len(column) <= row:
            column.append([])
        column[row] = delta
        sent[key] = len(values)
    return out
