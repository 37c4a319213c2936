"""The round profile's arithmetic for the SGLang benchmarks (``plugin_round_profile.py``, ``round_pairs.py``): a
profile's change over a set (:func:`delta`), per-round rows (:func:`per_round`), a set's passes pooled
(:func:`pooled`, :func:`added`), a set's serving figures (:func:`summary`) and its outputs against plain greedy's
(:func:`differences`). Pure Python over the dictionaries :func:`treespec_sglang.plugin.profile.read_profile`
returns and SGLang's outputs; no engine, no sglang import."""

from __future__ import annotations

import statistics


def differences(outputs: list, plain: list) -> list:
    """``[(request, position, token, plain's token)]``: each request whose greedy output is not plain's, at its
    first differing token (a length difference counts at the shorter one's end, with token -1 there)."""
    out = []
    for i, (a, b) in enumerate(zip(outputs, plain)):
        if a == b:
            continue
        p = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out.append((i, p, a[p] if p < len(a) else -1, b[p] if p < len(b) else -1))
    return out


def delta(after: dict, before: dict) -> dict:
    """Per round kind, ``after - before`` of two :func:`read_profile` results."""
    out = {}
    for kind, tot in after.items():
        b = before.get(kind, {"rounds": 0, "round_s": 0.0, "parts": {}, "ops": {}})
        if tot["rounds"] == b["rounds"]:
            continue
        out[kind] = {"rounds": tot["rounds"] - b["rounds"], "round_s": tot["round_s"] - b["round_s"]}
        for key in ("parts", "ops"):  # the entries that changed (an op count with no host read included)
            out[kind][key] = {name: [v[0] - b[key].get(name, [0, 0])[0], v[1] - b[key].get(name, [0, 0])[1]]
                              for name, v in tot[key].items() if list(v) != list(b[key].get(name, [0, 0]))}
    return out


def per_round(prof: dict) -> dict:
    """ms per round: total, SGLang's, the plugin's, and every part; ops and host reads per round per hook."""
    n = prof["rounds"]
    parts = {name: 1e3 * s / n for name, (s, _) in prof["parts"].items()}
    return {"rounds": n, "ms": 1e3 * prof["round_s"] / n,
            "sglang_ms": sum(v for k, v in parts.items() if k.startswith("sglang:")),
            "plugin_ms": sum(v for k, v in parts.items() if k.startswith("hook:")), "parts": parts,
            "ops": {name: [o / n, r / n] for name, (o, r) in prof.get("ops", {}).items()}}


def summary(seconds: float, outs: list, n: int = 0) -> dict:
    """A set's figures (``plugin_round_profile.serve``) of ``outs`` (SGLang's outputs) served in ``seconds``: tokens
    per second and tau over every request; with ``n`` (SGLang's N) the share of treespec request-rounds verified at
    N tokens (``padded``) and the mean verified tokens."""
    meta = [o["meta_info"] for o in outs]
    rounds = sum(m.get("spec_verify_ct", 0) for m in meta)
    verified = [v for m in meta for v in (m.get("treespec_verify_tokens") or [])]
    return {"seconds": seconds, "tok_s": sum(m["completion_tokens"] for m in meta) / seconds,
            "tau": 1 + sum(m.get("spec_num_correct_drafts", 0) for m in meta) / rounds if rounds else None,
            "verified": sum(verified) / len(verified) if verified else None,
            "padded": sum(v == n for v in verified) / len(verified) if verified and n else None,
            "outputs": [list(o["output_ids"]) for o in outs]}


def pooled(passes: list, n: int = 0) -> dict:
    """One set's passes ``[(prompt indices, seconds, outputs, profile delta)]`` as one row: per round kind
    :func:`per_round` over all its rounds, where ``ms`` is the median of the passes' own means when there are
    several (``ms_passes``: each; a slow pass, such as one that compiled, moves a median least), and
    :func:`summary` over every request, the outputs back in prompt order."""
    order, outs, seconds, prof = [], [], 0.0, {}
    for idx, sec, got, p in passes:
        order, outs, seconds, prof = order + list(idx), outs + list(got), seconds + sec, added(prof, p)
    row = {kind: per_round(p) for kind, p in prof.items()}
    if len(passes) > 1:
        for kind, r in row.items():
            r["ms_passes"] = [per_round(p[kind])["ms"] for *_, p in passes if kind in p]
            r["ms"] = statistics.median(r["ms_passes"])
    row.update(summary(seconds, [o for _, o in sorted(zip(order, outs), key=lambda t: t[0])], n))
    return row


def added(a: dict, b: dict) -> dict:
    """Two :func:`delta` results summed, per round kind."""
    out = {kind: {"rounds": p["rounds"], "round_s": p["round_s"], "parts": dict(p["parts"]),
                  "ops": dict(p.get("ops", {}))} for kind, p in a.items()}
    for kind, p in b.items():
        o = out.setdefault(kind, {"rounds": 0, "round_s": 0.0, "parts": {}, "ops": {}})
        o["rounds"], o["round_s"] = o["rounds"] + p["rounds"], o["round_s"] + p["round_s"]
        for key in ("parts", "ops"):
            for name, v in p.get(key, {}).items():
                w = o[key].get(name, [0, 0])
                o[key][name] = [w[0] + v[0], w[1] + v[1]]
    return out
