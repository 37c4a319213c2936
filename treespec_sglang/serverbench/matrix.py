"""The benchmark matrix: server-level settings x per-request policies x budgets x concurrency x temperature.

A *server setting* needs a server (re)start (``plain`` or ``eagle:TOPK/STEPS/N``); everything else is per
request (``custom_params["treespec"]``), so one server serves many cells. Every EAGLE server gets a
``native`` row (SGLang's own tree, no custom params) next to the policies, and a ``plain`` server gives the
no-speculation baseline, all in the same run.

>>> [s.label for s in parse_servers("plain,eagle:4/3/8")]
['plain', 'eagle(k4,s3,N8)']
>>> [c.label for c in build_matrix(parse_servers("eagle:4/3/8"), ["talon"], ["N"], [1], [0.0])]
['eagle(k4,s3,N8) native c1 T0', 'eagle(k4,s3,N8) talon(b8) c1 T0']
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence

__all__ = ["ServerSetting", "Cell", "parse_servers", "parse_list", "policy_spec", "build_matrix", "POLICY_NAMES"]

POLICY_NAMES = ("eagle2", "talon", "salf", "c2t", "chain")
_EAGLE = re.compile(r"^eagle:(\d+)/(\d+)/(\d+)$")


@dataclass(frozen=True)
class ServerSetting:
    """One server start: no speculation, or EAGLE with topk / steps / num-draft-tokens (N)."""

    algorithm: str  # "none" | "EAGLE"
    topk: int = 0
    steps: int = 0
    n: int = 0

    def __post_init__(self):
        if self.algorithm not in ("none", "EAGLE"):
            raise ValueError(f"server algorithm must be 'none' or 'EAGLE', got {self.algorithm!r}")
        if self.algorithm == "EAGLE":
            for name, v, lo in (("topk", self.topk, 1), ("steps", self.steps, 1), ("N", self.n, 2)):
                if not isinstance(v, int) or v < lo:
                    raise ValueError(f"eagle server {name} must be an integer >= {lo}, got {v!r}")
            if self.topk == 1 and self.n != self.steps + 1:
                raise ValueError(f"eagle server with topk 1 (chain) needs N = steps + 1 = {self.steps + 1}, "
                                 f"got {self.n}")

    @property
    def label(self) -> str:
        return "plain" if self.algorithm == "none" else f"eagle(k{self.topk},s{self.steps},N{self.n})"

    def launch_args(self, algorithm: str = "EAGLE") -> List[str]:
        """``launch_server`` flags; ``algorithm`` is ``EAGLE3`` for an EAGLE-3 draft (the draft decides)."""
        if self.algorithm == "none":
            return []
        return ["--speculative-algorithm", algorithm, "--speculative-eagle-topk", str(self.topk),
                "--speculative-num-steps", str(self.steps), "--speculative-num-draft-tokens", str(self.n)]


def parse_servers(text: str) -> List[ServerSetting]:
    """``"plain,eagle:4/3/8"`` -> settings (order kept, duplicates dropped)."""
    out = []
    for item in parse_list(text, "--servers"):
        m = _EAGLE.match(item)
        if item == "plain":
            s = ServerSetting("none")
        elif m:
            s = ServerSetting("EAGLE", *(int(g) for g in m.groups()))
        else:
            raise ValueError(f"--servers: each item must be 'plain' or 'eagle:TOPK/STEPS/N' (e.g. eagle:4/3/8), "
                             f"got {item!r}")
        if s not in out:
            out.append(s)
    return out


def parse_list(text: str, field: str) -> List[str]:
    items = [x.strip() for x in str(text or "").split(",") if x.strip()]
    if not items:
        raise ValueError(f"{field}: give at least one comma-separated value, got {text!r}")
    return items


def policy_spec(name: str, budget: int, server: ServerSetting, extra: Optional[dict] = None) -> dict:
    """The ``custom_params["treespec"]`` dict of one policy at one budget, sized to the server's beam."""
    if name not in POLICY_NAMES:
        raise ValueError(f"--policies: each must be one of {list(POLICY_NAMES)}, got {name!r}")
    k, s = server.topk, server.steps
    spec = {"eagle2": {"policy": "eagle2", "budget": budget, "topk": k, "depth": s},
            "talon": {"policy": "talon", "budget": budget, "topk": k, "mu": 0.03},
            "salf": {"policy": "salf", "budget": budget, "th": 0.1},
            "c2t": {"policy": "c2t", "budget": budget, "topk": k, "beta": 0.5},
            "chain": {"policy": "chain", "length": max(1, min(s, budget - 1))}}[name]
    spec.update((extra or {}).get(name, {}))
    return spec


@dataclass(frozen=True)
class Cell:
    """One row of the table: a server setting, a request policy (None: native / plain), concurrency, T."""

    server: ServerSetting
    policy: Optional[str]  # None: SGLang's own (native EAGLE tree, or plain decoding)
    budget: Optional[int]
    concurrency: int
    temperature: float
    spec_json: Optional[str] = None  # the request's treespec dict, as JSON (hashable)

    def __post_init__(self):
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"--concurrency values must be integers >= 1, got {self.concurrency!r}")
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"--temperatures values must be in [0, 100], got {self.temperature!r}")

    @property
    def spec(self) -> Optional[dict]:
        return json.loads(self.spec_json) if self.spec_json else None

    @property
    def policy_label(self) -> str:
        if self.policy is None:
            return "plain" if self.server.algorithm == "none" else "native"
        return f"{self.policy}(b{self.budget})"

    @property
    def label(self) -> str:
        return f"{self.server.label} {self.policy_label} c{self.concurrency} T{self.temperature:g}"


def build_matrix(servers: Sequence[ServerSetting], policies: Sequence[str], budgets: Sequence[str],
                 concurrency: Sequence[int], temperatures: Sequence[float], extra: Optional[dict] = None) -> List[Cell]:
    """Every cell, grouped by server (one start each). ``budgets`` items are integers or ``"N"`` (the
    server's N); a budget above a server's N is skipped for that server (its beam cannot hold it)."""
    cells = []
    for server in servers:
        rows = [(None, None, None)]
        if server.algorithm == "EAGLE":
            seen = set()
            for b in budgets:
                b = server.n if str(b) == "N" else _int(b, "--budgets")
                if b > server.n or b in seen:
                    continue
                seen.add(b)
                rows += [(p, b, json.dumps(policy_spec(p, b, server, extra), sort_keys=True)) for p in policies]
        for p, b, spec in rows:
            for c in concurrency:
                for t in temperatures:
                    cells.append(Cell(server, p, b, int(c), float(t), spec))
    return cells


def _int(v, field: str) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: each value must be an integer >= 1 or 'N', got {v!r}") from None
    if n < 1:
        raise ValueError(f"{field}: each value must be an integer >= 1 or 'N', got {v!r}")
    return n
