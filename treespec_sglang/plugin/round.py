"""One speculative round's plugin state, in one object (no sglang import).

SGLang 0.5.23's EAGLE v2 worker runs a decode round in one ``EAGLEWorkerV2.forward_batch_generation`` call:
draft (SGLang's beam, then the tree the verify checks), verify (the target's forward and the accept walk),
draft extend. The plugin's hook on that call opens a :class:`PluginRound` (:func:`opened`); the hooks that run
inside it read and fill that one object, in the order a round runs:

| field | written by | read by |
|---|---|---|
| ``reqs`` | ``forward_batch_generation`` (the round's requests) | the verify-token stats |
| ``step`` | ``EagleDraftWorker.draft``: policies, shares, token cap; the graph runner (``prepare_for_draft``); ``keep`` after the selection (``build_eagle_verify_input``) | the draft hooks, the verify forward (ragged verify from ``keep``), the graph counter |
| ``drafting`` | ``EagleDraftWorker.draft`` (True while SGLang's draft runs) | ``drafting_step()``: the draft loop, selection and verify-input hooks |
| ``plan`` | the ragged verify forward | the attention hooks of that forward (``IntelAMXAttnBackend``, FlashInfer arguments, ``can_run_graph``) |
| ``ragged`` | the verify forward (True when it ran the kept nodes only, eagerly) | ``forward_batch_generation``: the round's result reports no CUDA graph for the verify |

Two things outlive a round on purpose and are not here: the draft-pool stash (:mod:`.draft_select`: buffers a
captured CUDA graph writes on every replay) and the pending tree sizes (:mod:`.stats`: host copies that complete
after the round). A draft without an open round (a code path that drafts outside ``forward_batch_generation``)
opens one for itself: its tree is still verified exactly (the filler is unlinked in the verify input), only the
ragged verify and the verify-token stats need the round to reach the verify.

Example
-------
>>> with opened(["req-a"]) as r:
...     current() is r, drafting_step() is None
(True, True)
>>> current() is None
True
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from dataclasses import dataclass
from typing import Iterator, List, Optional

import torch

__all__ = ["DraftStep", "PluginRound", "current", "opened", "drafting_step", "same_requests"]


def same_requests(reqs, held: tuple) -> bool:
    """Whether ``reqs`` are the requests ``held``, in order: by identity (SGLang's ``Req`` has no ``__eq__``; a
    stand-in's value equality must not pass for it), one C-level pass. What the per-batch caches key on: a decode
    batch keeps its requests from round to round. ``held`` itself (a tuple: it cannot change) is decided without
    the pass, and a batch whose last request differs (SGLang appends new requests) without it."""
    if reqs is held:
        return True
    n = len(held)
    # the last request first: a batch that changed has a new one there (SGLang appends those) or fewer requests
    return len(reqs) == n and (n == 0 or reqs[-1] is held[-1]) and all(map(operator.is_, reqs, held))


@dataclass
class DraftStep:
    """The draft step's per-row policies (None = SGLang's own tree) and what the draft hooks add to them.

    ``params`` one per row; ``topk`` the server's; ``shares[b]`` row b is under the token cap of ``token_cap``
    verified tokens per sharing request (None: off); ``keep`` ``[bs, N]`` bool, the kept verify nodes once
    selected (:meth:`selected`); ``chain`` the C2T chain stopper in chain mode; ``runner`` SGLang's draft graph
    runner when this round's draft is a replay.
    """

    params: List
    topk: int
    shares: Optional[List[bool]] = None
    token_cap: Optional[int] = None
    keep: Optional[torch.Tensor] = None
    chain: object = None
    runner: object = None
    _sizes: Optional[tuple] = None  # (keep, its [bs] sizes) as the selection graph computed them

    def __post_init__(self):
        if self.shares is None:
            self.shares = [False] * len(self.params)

    def selected(self, keep: torch.Tensor, sizes: Optional[torch.Tensor] = None) -> None:
        """The round's kept verify nodes ``keep`` ``[bs, N]`` bool, with ``sizes`` ``[bs]`` int64 = ``keep.sum(-1)``
        when the selection computed them already (inside its CUDA graph: no launch of their own)."""
        self.keep = keep
        self._sizes = None if sizes is None else (keep, sizes)

    @property
    def sizes(self) -> Optional[torch.Tensor]:
        """``[bs]`` int64 verified tree sizes (root included), once the selection is made."""
        if self.keep is None:
            return None
        if self._sizes is not None and self._sizes[0] is self.keep:  # keep may be set again after the selection
            return self._sizes[1]
        return self.keep.sum(-1)  # a bool sum is int64


@dataclass
class PluginRound:
    """One round's state (see the module table)."""

    reqs: Optional[list] = None
    step: Optional[DraftStep] = None
    drafting: bool = False
    plan: object = None  # the ragged verify's RaggedVerify while its forward runs
    ragged: bool = False  # the verify forward ran the kept nodes only (eagerly: no CUDA graph)

    @property
    def keep(self) -> Optional[torch.Tensor]:
        """``[bs, N]`` bool, the kept verify nodes of this round's treespec draft (None: native or none yet)."""
        return None if self.step is None else self.step.keep

    def carries_treespec(self) -> bool:
        """Whether a request of this round has a treespec policy (its draft step, or its requests' params)."""
        if self.step is not None:
            return True
        return any(getattr(r, "_treespec_params", None) is not None for r in (self.reqs or ()))


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("treespec_round", default=None)


def current() -> Optional[PluginRound]:
    """The round in progress in this thread (None outside one)."""
    return _CURRENT.get()


@contextlib.contextmanager
def opened(reqs: Optional[list] = None) -> Iterator[PluginRound]:
    """Open a round for the enclosed calls; it is gone when they return (or raise)."""
    r = PluginRound(reqs)
    token = _CURRENT.set(r)
    try:
        yield r
    finally:
        _CURRENT.reset(token)


def drafting_step() -> Optional[DraftStep]:
    """The draft step while SGLang's draft of a treespec round runs (None otherwise: native rounds, verify,
    draft extend)."""
    r = _CURRENT.get()
    return r.step if r is not None and r.drafting else None
