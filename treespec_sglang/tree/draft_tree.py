"""The batched, padded draft tree shared by policies, verification, attention and the engine.

Conventions:

* node 0 is the root: the last committed token (SGLang's "bonus" token);
* parents precede children, ``parents[:, 0] == -1``;
* padding entries (index >= ``size``) hold token -1, parent -1, depth -1 and log-prob -inf;
* ``logprob`` is the path log-probability under the draft (root 0.0), so it never
  increases along a path (EAGLE-2 §4.1, the value V).

Shapes use one vocabulary: ``bs, n_nodes, width, depth, vocab, hidden``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["DraftTree", "stack_rows"]


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees, one per request, padded to a common ``n_nodes``.

    Parameters
    ----------
    tokens : torch.Tensor
        ``[bs, n_nodes]`` int64 token ids, -1 for padding.
    parents : torch.Tensor
        ``[bs, n_nodes]`` int64 parent node index, -1 for the root and padding.
    depth : torch.Tensor
        ``[bs, n_nodes]`` int64 depth (root 0), -1 for padding.
    logprob : torch.Tensor
        ``[bs, n_nodes]`` float32 path log-probability under the draft (root 0, padding -inf).
    size : torch.Tensor
        ``[bs]`` int64 number of valid nodes (root included).
    depth_bound : int, optional
        Host-side static upper bound on ``depth`` (lets consumers loop without a sync).
        Defaults to ``n_nodes - 1``.

    Examples
    --------
    >>> t = DraftTree.from_lists([[5, 7, 8, 9]], [[-1, 0, 0, 1]])
    >>> t.depth.tolist()
    [[0, 1, 1, 2]]
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    logprob: torch.Tensor
    size: torch.Tensor
    depth_bound: Optional[int] = None

    def __post_init__(self) -> None:
        # Cheap checks only (shapes / dtypes / devices): no host sync here.
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens must be [bs, n_nodes], got shape {tuple(self.tokens.shape)}")
        shape = self.tokens.shape
        for name in ("tokens", "parents", "depth"):
            t = getattr(self, name)
            if t.shape != shape or t.dtype != torch.int64:
                raise ValueError(f"{name} must be int64 {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")
        if self.logprob.shape != shape or self.logprob.dtype != torch.float32:
            raise ValueError(f"logprob must be float32 {tuple(shape)}, got {self.logprob.dtype} {tuple(self.logprob.shape)}")
        if self.size.shape != (shape[0],) or self.size.dtype != torch.int64:
            raise ValueError(f"size must be int64 [{shape[0]}], got {self.size.dtype} {tuple(self.size.shape)}")
        if shape[1] < 1:
            raise ValueError("n_nodes must be >= 1 (the root)")
        if self.depth_bound is None:
            object.__setattr__(self, "depth_bound", shape[1] - 1)
        elif not 0 <= self.depth_bound:
            raise ValueError(f"depth_bound must be >= 0, got {self.depth_bound}")

    # ------------------------------------------------------------------ properties
    @property
    def bs(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def valid(self) -> torch.Tensor:
        """``[bs, n_nodes]`` bool: node index < size."""
        ar = torch.arange(self.n_nodes, device=self.device)
        return ar[None, :] < self.size[:, None]

    def to(self, device) -> "DraftTree":
        return DraftTree(self.tokens.to(device), self.parents.to(device), self.depth.to(device),
                         self.logprob.to(device), self.size.to(device), self.depth_bound)

    # ------------------------------------------------------------------ constructors
    @staticmethod
    def from_lists(tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]],
                   logprob: Optional[Sequence[Sequence[float]]] = None, device=None) -> "DraftTree":
        """Build a padded batch from per-request Python lists (tests, examples; not a hot path)."""
        bs = len(tokens)
        n = max(len(t) for t in tokens)
        tok = torch.full((bs, n), -1, dtype=torch.int64)
        par = torch.full((bs, n), -1, dtype=torch.int64)
        dep = torch.full((bs, n), -1, dtype=torch.int64)
        lp = torch.full((bs, n), float("-inf"), dtype=torch.float32)
        for b, (ts, ps) in enumerate(zip(tokens, parents)):
            if len(ts) != len(ps):
                raise ValueError(f"request {b}: tokens and parents differ in length")
            for i, (t, p) in enumerate(zip(ts, ps)):
                if (i == 0) != (p == -1) or p >= i:
                    raise ValueError(f"request {b} node {i}: parent {p} must be -1 for the root and < {i} otherwise")
                tok[b, i], par[b, i] = t, p
                dep[b, i] = 0 if i == 0 else dep[b, p] + 1
                lp[b, i] = 0.0 if logprob is None else logprob[b][i]
        size = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
        tree = DraftTree(tok, par, dep, lp, size, int(dep.max()))
        return tree.to(device) if device is not None else tree

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Full structural validation (syncs; for tests and debugging, not hot paths).

        Raises ``ValueError`` naming the request and node that break a convention.
        """
        n = self.n_nodes
        ar = torch.arange(n, device=self.device)
        valid = self.valid
        if bool((self.size < 1).any()) or bool((self.size > n).any()):
            raise ValueError(f"size must be in [1, {n}], got {self.size.tolist()}")
        problems = []
        if bool((self.parents[:, 0] != -1).any()):
            problems.append("root parent != -1")
        if bool((self.depth[:, 0] != 0).any()):
            problems.append("root depth != 0")
        inner = valid & (ar[None, :] > 0)
        bad_par = inner & ((self.parents < 0) | (self.parents >= ar[None, :]))
        if bool(bad_par.any()):
            problems.append(f"parents must precede children at {bad_par.nonzero().tolist()[:5]}")
        pidx = self.parents.clamp(0, n - 1)  # a parent index out of range is reported above, not a gather error
        pdepth = torch.gather(self.depth, 1, pidx)
        bad_depth = inner & (self.depth != pdepth + 1)
        if bool(bad_depth.any()):
            problems.append(f"depth != parent depth + 1 at {bad_depth.nonzero().tolist()[:5]}")
        plp = torch.gather(self.logprob, 1, pidx)
        bad_lp = inner & ~(self.logprob <= plp + 1e-5)
        if bool(bad_lp.any()):
            problems.append(f"path logprob increases or is NaN at {bad_lp.nonzero().tolist()[:5]}")
        bad_tok = inner & (self.tokens < 0)
        if bool(bad_tok.any()):
            problems.append(f"negative token at {bad_tok.nonzero().tolist()[:5]}")
        pad = ~valid
        if bool((pad & ((self.tokens != -1) | (self.parents != -1) | (self.depth != -1))).any()):
            problems.append("padding must be token/parent/depth -1")
        if bool((valid & (self.depth > self.depth_bound)).any()):
            problems.append(f"depth exceeds depth_bound={self.depth_bound}")
        if problems:
            raise ValueError("invalid DraftTree: " + "; ".join(problems))

    def paths(self) -> list:
        """Per request, the token path (tuple, root token first) of every valid node (tests)."""
        out = []
        tok, par, size = self.tokens.tolist(), self.parents.tolist(), self.size.tolist()
        for b in range(self.bs):
            ps = []
            for i in range(size[b]):
                path, j = [], i
                while j >= 0:
                    path.append(tok[b][j])
                    j = par[b][j]
                ps.append(tuple(reversed(path)))
            out.append(ps)
        return out


def stack_rows(parts: Sequence[tuple], bs: int) -> DraftTree:
    """Scatter sub-batch trees back into one batch.

    Parameters
    ----------
    parts : sequence of (rows, DraftTree)
        ``rows`` is an int64 ``[bs_g]`` tensor of destination rows; the groups partition ``range(bs)``.
    bs : int
        Full batch size.

    Returns
    -------
    DraftTree
        ``[bs, max n_nodes]``, shorter trees padded.
    """
    if len(parts) == 1 and parts[0][1].bs == bs:
        rows, tree = parts[0]
        return tree  # single group in natural order (the caller builds rows = arange)
    n = max(t.n_nodes for _, t in parts)
    dev = parts[0][1].device
    tok = torch.full((bs, n), -1, dtype=torch.int64, device=dev)
    par = torch.full_like(tok, -1)
    dep = torch.full_like(tok, -1)
    lp = torch.full((bs, n), float("-inf"), dtype=torch.float32, device=dev)
    size = torch.ones(bs, dtype=torch.int64, device=dev)
    for rows, t in parts:
        m = t.n_nodes
        tok[rows, :m] = t.tokens
        par[rows, :m] = t.parents
        dep[rows, :m] = t.depth
        lp[rows, :m] = t.logprob
        size[rows] = t.size
    return DraftTree(tok, par, dep, lp, size, max(t.depth_bound for _, t in parts))
