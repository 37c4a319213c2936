"""The filler unlink as one fused Triton launch (no sglang import; triton optional): after SGLang builds the verify
chains (``retrieve_next_token`` / ``retrieve_next_sibling``) from trees padded to N, :func:`unlink_filler_fused`
takes the padding out of them in place, as :func:`.pool.unlink_filler` (torch, and the oracle) does, with one
program per request (the kernel's source: ``unlink_kernel`` in :mod:`.pool_kernels_triton`, loaded with the
selection's by :func:`.pool_kernels.kernels`): a kept node's first child becomes its first kept child and its next
sibling its next kept sibling, fillers get -1 (pointer jumping along the sibling chains in a scratch row). Nothing is
read back; the scratch is kept per batch size, so a round allocates nothing and the launch can run after a
replayed draft. :func:`check_unlink` compiles it for the server's N at start and checks it against torch.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from .pool import unlink_filler
from .pool_kernels import grown_rows, interpreted, kernels

__all__ = ["unlink_filler_fused", "launch_unlink", "check_unlink"]


def unlink_filler_fused(next_token: torch.Tensor, next_sibling: torch.Tensor, keep: torch.Tensor,
                        work: Optional[torch.Tensor] = None) -> None:
    """:func:`.pool.unlink_filler` in place, one launch (a program per row): ``next_token`` / ``next_sibling``
    ``[bs, N]`` int64 (SGLang's ``retrieve_next_token`` / ``retrieve_next_sibling``), ``keep`` ``[bs, N]`` bool,
    all contiguous on one device. Nothing is read back. ``work``: the kernel's ``[bs, BLOCK_N]`` int64 scratch
    (None: the rounds' shared one, :func:`_unlink_scratch`).

    Raises
    ------
    ValueError
        Naming the tensor whose shape, dtype, device or layout the kernel cannot take (as strict as the launch).
    """
    bs, N = keep.shape
    for name, t, dtype in (("next_token", next_token, torch.int64), ("next_sibling", next_sibling, torch.int64),
                           ("keep", keep, torch.bool)):
        if t.shape != keep.shape or t.dtype != dtype or t.device != keep.device or not t.is_contiguous():
            raise ValueError(f"unlink_filler_fused: {name} must be a contiguous [{bs}, {N}] {dtype} tensor on "
                             f"{keep.device}, got {tuple(t.shape)} {t.dtype} on {t.device} "
                             f"(contiguous: {t.is_contiguous()})")
    if bs == 0:
        return
    if work is None:
        work = _unlink_scratch(bs, N, keep.device)  # [bs, BLOCK_N]
    launch_unlink(kernels(interpreted(keep.device)), next_token, next_sibling, keep, work)


_SCRATCH: Dict[tuple, tuple] = {}  # (BLOCK_N, device) -> (the unlink's [rows, BLOCK_N] int64 scratch, {bs: view})


def _unlink_scratch(bs: int, N: int, device) -> torch.Tensor:
    """The unlink kernel's ``[bs, BLOCK_N]`` int64 scratch (every program writes its row before reading it): the
    first ``bs`` rows of one buffer per width and device, grown (:func:`.pool_kernels.grown_rows`) when a bigger
    batch comes, the view kept per batch size, so a round allocates nothing and the memory is bounded by twice the
    largest batch.
    Reuse is safe in stream order: every unlink that takes it is a round's, launched on the server's forward stream,
    where the buffer is allocated too (the start check brings its own: a buffer allocated on the start-up stream,
    freed while a round's unlink may still run, would go back to that stream's free blocks)."""
    block_n = _block_n(N)
    key = (block_n, device)
    buf, views = _SCRATCH.get(key, (None, None))
    if buf is None or buf.shape[0] < bs:
        rows = grown_rows(None if buf is None else buf.shape[0], bs)
        buf, views = _SCRATCH[key] = (torch.empty(rows, block_n, dtype=torch.int64, device=device), {})
    work = views.get(bs)
    if work is None:
        work = views[bs] = buf[:bs]
    return work


def _block_n(N: int) -> int:
    """The unlink's row width: the power of two above N - 1 (at least 2)."""
    return 1 << max(N - 1, 1).bit_length()


def launch_unlink(mod, next_token: torch.Tensor, next_sibling: torch.Tensor, keep: torch.Tensor,
                  work: torch.Tensor) -> None:
    """One launch of the unlink kernel (grid: the rows of ``keep`` ``[bs, N]``; ``work`` ``[bs, BLOCK_N]`` int64)."""
    bs, N = keep.shape
    mod.unlink_kernel[(bs,)](next_token, next_sibling, keep, work, N, BLOCK_N=work.shape[1],
                             ROUNDS=max(N, 2).bit_length())


def check_unlink(device, num_draft_tokens: int) -> None:
    """At server start: the unlink kernel loads, compiles for the server's N and rewrites three fixed trees'
    chains as :func:`.pool.unlink_filler` (torch) does, on ``device``. Row r's node i > 0 hangs below node
    ``(i - 1) // (3, 5, 8)[r]``, siblings linked from the highest index down (so a chain is not in index order),
    and every node of index 2, 3 or 4 mod 5 is dropped with its subtree (runs of fillers on a chain: several
    rounds of jumps).

    Raises
    ------
    RuntimeError
        When triton cannot load, or the kernel's chains differ from torch's on this device (then the server must
        not start with the fused path: ``TREESPEC_SELECT=torch`` runs the torch selection and unlink).
    """
    N = num_draft_tokens
    nt = torch.full((3, N), -1, dtype=torch.int64)
    ns = torch.full((3, N), -1, dtype=torch.int64)
    keep = torch.zeros(3, N, dtype=torch.bool)
    for r in range(3):
        parent = [-1] + [(i - 1) // (3, 5, 8)[r] for i in range(1, N)]
        for i in range(1, N):  # prepend: the chain runs from the highest index down
            ns[r, i], nt[r, parent[i]] = nt[r, parent[i]], i
        for i in range(N):
            keep[r, i] = i == 0 or (i % 5 < 2 and bool(keep[r, parent[i]]))
    want = unlink_filler(nt, ns, keep)
    # twice: on tensors of their own, and as rows 1 and 2 of one [3, bs, N] buffer, as SGLang hands them over:
    # row 1 then starts bs * N int64s in, off Triton's 16-byte alignment when bs * N is odd, a variant of its
    # own (compiled here, not in the first round of such a batch)
    buf = torch.stack([torch.zeros_like(nt), nt, ns]).to(device)
    work = torch.empty(3, _block_n(N), dtype=torch.int64, device=device)  # its own: not the rounds' scratch
    for got_t, got_s in ((nt.to(device), ns.to(device)), (buf[1], buf[2])):
        unlink_filler_fused(got_t, got_s, keep.to(device), work)
        if torch.equal(got_t.cpu(), want[0]) and torch.equal(got_s.cpu(), want[1]):
            continue
        raise RuntimeError(f"the fused filler unlink (pool_kernels_triton.unlink_kernel) disagrees with the torch "
                           f"unlink on {device} at N {N}; start with TREESPEC_SELECT=torch and report this (got "
                           f"next_token {got_t.cpu().tolist()}, want {want[0].tolist()})")
