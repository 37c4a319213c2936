"""``grow_tree``: run every request's policy in lockstep over one batched ``expand`` per step."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from ..tree import DraftTree, stack_rows
from .base import POLICIES, TreePolicy, parse_spec, sanitize_logprobs
from .registry import registration_of
from .params import PolicyParams

__all__ = ["grow_tree", "parse_specs", "ExpandFn"]

ExpandFn = Callable[[DraftTree, torch.Tensor], torch.Tensor]


def parse_specs(specs: Sequence) -> List[PolicyParams]:
    """Validate every request's spec; the error names the request index, the field and its range."""
    out = []
    for i, s in enumerate(specs):
        try:
            out.append(parse_spec(s))
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
    return out


def _check_inputs(bs: int, root_tokens: torch.Tensor, root_logprobs: torch.Tensor) -> None:
    if root_tokens.shape != (bs,) or root_tokens.dtype != torch.int64:
        raise ValueError(f"root_tokens must be int64 [{bs}], got {root_tokens.dtype} {tuple(root_tokens.shape)}")
    if root_logprobs.dim() != 2 or root_logprobs.shape[0] != bs or not root_logprobs.is_floating_point():
        raise ValueError(f"root_logprobs must be float [{bs}, vocab], got {root_logprobs.dtype} "
                         f"{tuple(root_logprobs.shape)}")


def _check_logprobs(root_logprobs: torch.Tensor) -> None:
    """Root rows must be log-probabilities: total mass <= 1 (logsumexp <= 0; a row restricted to candidates
    may hold less). NaN / +inf entries are the policies' defined case (never chosen), so they are left out of
    the sum, as the policies treat them. One host read."""
    lse = torch.logsumexp(sanitize_logprobs(root_logprobs.float()), -1)  # [bs]
    bad = lse > 1e-3
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"root_logprobs row {i} is not a log-probability distribution (logsumexp "
                         f"{float(lse[i]):.4g}, must be <= 0; pass log_softmax(logits), not logits)")


def _waiting(groups) -> torch.Tensor:
    """``[]`` bool: a policy of ``groups`` has a row that steps on without children (:meth:`TreePolicy.waiting`)."""
    return torch.stack([g[1].waiting() for g in groups]).any()


def grow_tree(specs: Sequence, root_tokens: torch.Tensor, root_logprobs: torch.Tensor,
              expand: ExpandFn, *, sync_free: bool = False, validate: bool = True,
              min_logprob: Optional[torch.Tensor] = None) -> DraftTree:
    """Build one draft tree per request, each with its own policy, in one batched loop.

    Parameters
    ----------
    specs : list of dict
        One per request, e.g. ``{"policy": "talon", "budget": 60, "topk": 10, "mu": 0.03}``.
        See :mod:`treespec_sglang.policies.params` for every policy's fields and defaults.
    root_tokens : torch.Tensor
        ``[bs]`` int64, the last committed token of each request (node 0).
    root_logprobs : torch.Tensor
        ``[bs, vocab]`` draft log-probs of the root's children.
    expand : callable
        ``expand(tree, frontier) -> [bs, width, vocab]`` draft log-probs of the children of
        ``frontier`` (``[bs, width]`` node indices into ``tree``, -1 = none; rows for -1 are
        ignored and may hold anything). ``tree`` holds every node the frontier may need as
        ancestors. Called at most once per step for the whole batch.
    sync_free : bool
        If False (default), stop as soon as no request has a frontier (one host sync per
        step). If True, run each policy's static step bound with no host sync at all
        (CUDA-graph style; the extra steps see all -1 frontiers).
    validate : bool
        If True (default), check that ``root_logprobs`` are log-probabilities, total mass <= 1
        (raw logits would silently mis-rank the tree; one host read per call; skipped with
        ``sync_free``). Engines whose inputs come from ``log_softmax`` pass False (no sync). NaN / +inf
        entries are not an error: policies never choose them. ``expand``'s output shape is always checked.
    min_logprob : torch.Tensor, optional
        ``[bs]`` float: a request expands only frontier nodes whose path log-probability is at least
        this (-inf: no pruning). A pruned node gets no children (its policy sees an all ``-inf`` child
        row), and ``expand`` never sees it: the token cap's draft pruning, since a child's path
        probability never exceeds its parent's, so nothing under a pruned node could be worth verifying.
        Every step then costs one host read of the live count (instead of the early-exit check), and an
        ``expand`` with ``ragged = True`` is called as ``expand(tree, frontier, n_live=count)`` so it can
        run only the live rows. Not with ``sync_free``.

    Returns
    -------
    DraftTree
        ``[bs, max budget]``; requests keep their input order.

    Raises
    ------
    ValueError
        On a bad spec (naming the request, field and allowed range), an empty batch, bad input
        shapes or (``validate``) logits passed as log-probs, before any compute; on an ``expand``
        result of the wrong shape (vocab included) at the step it happens.

    Examples
    --------
    >>> lp = torch.log_softmax(torch.randn(2, 50), -1)
    >>> tree = grow_tree([{"policy": "chain", "length": 3}, {"policy": "eagle2", "budget": 8}],
    ...                  torch.tensor([1, 2]), lp, lambda t, f: lp[:, None, :].expand(2, f.shape[1], 50))
    >>> tree.size.tolist()
    [4, 8]
    """
    params = parse_specs(specs)
    bs = len(params)
    if bs == 0:
        raise ValueError("specs must hold at least one request (got an empty batch)")
    _check_inputs(bs, root_tokens, root_logprobs)
    if validate and not sync_free:
        _check_logprobs(root_logprobs)
    vocab = root_logprobs.shape[1]
    dev = root_tokens.device
    by_policy = {}
    for i, p in enumerate(params):
        name = registration_of(p).name
        by_policy.setdefault(name, []).append(i)
    groups: List[tuple] = []  # (rows tensor, policy, frontier)
    for name, rows in by_policy.items():
        pol: TreePolicy = POLICIES[name]([params[i] for i in rows], dev)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        sub_tok = root_tokens if len(rows) == bs else root_tokens[rows_t]
        sub_lp = root_logprobs if len(rows) == bs else root_logprobs[rows_t]
        groups.append([rows_t, pol, pol.start(sub_tok, sub_lp)])

    if min_logprob is not None:
        if sync_free:
            raise ValueError("min_logprob (draft pruning) reads the live count every step: not with sync_free")
        min_logprob = torch.as_tensor(min_logprob, dtype=torch.float32, device=dev).expand(bs)
    n_steps = max(g[1].max_steps for g in groups)
    for step in range(n_steps):
        live = [g for g in groups if step < g[1].max_steps]
        if not live:
            break
        expanding = True
        if min_logprob is None and not sync_free:  # the one host sync per step
            code = int(torch.stack([(g[2] >= 0).any() for g in live]).any() * 2 + _waiting(live))  # 2: expanding
            if code == 0:
                break  # nobody has anything left to expand
            expanding = code >= 2
        tree = stack_rows([(g[0], g[1].tree) for g in groups], bs)
        width = max(g[2].shape[1] for g in live)
        if len(groups) == 1:
            frontier = groups[0][2]
        else:
            frontier = torch.full((bs, width), -1, dtype=torch.int64, device=dev)
            for rows, _, fr in live:
                frontier[rows, :fr.shape[1]] = fr
        pruned = None
        if min_logprob is not None:  # [bs, width] nodes below their request's threshold are not expanded
            lp = torch.gather(tree.logprob, 1, frontier.clamp(min=0))
            pruned = (frontier >= 0) & ~(lp >= min_logprob[:, None])
            frontier = torch.where(pruned, -1, frontier)
            n_live = int((frontier >= 0).sum())  # the one host read of this step
            expanding = n_live > 0
            if not expanding and not bool(_waiting(live)):
                break  # (a second read only when nothing is live)
        if not expanding:  # only rows that step on without children (waiting): no draft forward
            child = torch.full((bs, frontier.shape[1], vocab), float("-inf"), device=dev)
        elif pruned is not None and getattr(expand, "ragged", False):
            child = expand(tree, frontier, n_live=n_live)
        else:
            child = expand(tree, frontier)  # [bs, width, vocab]
        if child.dim() != 3 or child.shape != (*frontier.shape, vocab):
            raise ValueError(f"expand must return [bs, width, vocab] = [{bs}, {frontier.shape[1]}, {vocab}] "
                             f"(vocab as root_logprobs), got {tuple(child.shape)}")
        if pruned is not None:  # a pruned node has no children: an all -inf row for its policy
            child = child.masked_fill(pruned[:, :, None], float("-inf"))
        for g in live:
            rows, pol, fr = g
            sub = child if len(groups) == 1 else child[rows, :fr.shape[1]]
            g[2] = pol.step(sub)
    return stack_rows([(g[0], g[1].finish()) for g in groups], bs)
