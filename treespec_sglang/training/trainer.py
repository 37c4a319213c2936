"""Draft-head training with multi-step test-time training (TTT) over self-distillation data.

Step 0 feeds the target's real features: the pair at draft position t is (h_t, x_{t+1}) at RoPE
position t+1 and predicts the target's distribution of x_{t+2}, p_t = softmax(lm_head(h_{t+1})).
Step k >= 1 feeds the draft's own step-(k-1) output from position t-1 (what a depth-(k+1) tree node
sees at inference) and attends HASS-style: to step-0 keys at positions <= t-k (the committed
prefix) and to the step-j key at position t-k+j for j = 1..k (its own ancestors). Losses per step
are weighted gamma^k (:func:`multi_step_loss`).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .losses import acceptance_rate, kl_loss, lk_alpha_loss, lk_lambda_loss, multi_step_loss, talf_loss
from .talf import batch_trees, talf_forward

__all__ = ["TrainConfig", "LOSSES", "ttt_forward", "step_logits", "draft_logits", "batch_sequences", "talf_batch_loss", "train_draft",
           "evaluate_alpha"]

LOSSES: Dict[str, Callable] = {  # (target logits, draft logits, mask, cfg, d2t) -> scalar
    "kl": lambda t, d, m, cfg, d2t: kl_loss(t, d, m, d2t),
    "lk-alpha": lambda t, d, m, cfg, d2t: lk_alpha_loss(t, d, m, d2t),
    "lk-lambda": lambda t, d, m, cfg, d2t: lk_lambda_loss(t, d, m, d2t, eta=cfg.eta),
}


@dataclass(frozen=True)
class TrainConfig:
    loss: str = "kl"
    steps: int = 200
    lr: float = 3e-4
    batch_size: int = 4
    ttt_steps: int = 3
    gamma: float = 0.8
    eta: float = 3.0
    max_len: int = 384
    seed: int = 0
    eval_every: int = 50

    def __post_init__(self):
        if self.loss not in LOSSES and self.loss != "talf":
            raise ValueError(f"loss must be one of {sorted(LOSSES) + ['talf']}, got {self.loss!r}")
        for name, lo in (("steps", 1), ("batch_size", 1), ("ttt_steps", 1), ("max_len", 8), ("eval_every", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if not (0 < self.lr < 1 and 0 < self.gamma <= 1 and self.eta >= 0):
            raise ValueError("lr must be in (0, 1), gamma in (0, 1], eta >= 0")


def batch_sequences(seqs, max_len: int, device="cpu"):
    """Pad (tokens [T], hidden [T, H], loss_mask [T]) sequences into a batch (truncating to max_len).

    Returns tokens [bs, T] int64, hidden [bs, T, H] float32, loss_mask [bs, T] bool, lens [bs].
    """
    seqs = [(s[0][:max_len], s[1][:max_len], s[2][:max_len]) for s in seqs]  # TALF items carry a 4th field
    bs, T, H = len(seqs), max(len(t) for t, _, _ in seqs), seqs[0][1].shape[-1]
    tok = torch.zeros(bs, T, dtype=torch.long)
    hid = torch.zeros(bs, T, H)
    msk = torch.zeros(bs, T, dtype=torch.bool)
    for b, (t, h, m) in enumerate(seqs):
        tok[b, :len(t)], hid[b, :len(t)], msk[b, :len(t)] = t, h.float(), m
    lens = torch.tensor([len(t) for t, _, _ in seqs])
    return tok.to(device), hid.to(device), msk.to(device), lens.to(device)


def ttt_forward(head, tokens, hidden, loss_mask, lens, ttt_steps: int):
    """Run the draft for ``ttt_steps`` steps.

    tokens [bs, T], hidden [bs, T, hidden], loss_mask [bs, T], lens [bs]; draft positions
    t = 0..T-3. Returns (steps, target_hidden) where steps is a list of (draft features
    [bs, n, hidden], valid [bs, n] bool) and target_hidden [bs, n, hidden] is h_{t+1}, whose LM-head
    distribution p_t is every step's target at position t.
    """
    bs, T = tokens.shape
    n = T - 2
    dev = tokens.device
    t = torch.arange(n, device=dev)
    pos = (t + 1).expand(bs, n)
    toks = tokens[:, 1:n + 1]
    base_ok = (t[None, :] + 2 < lens[:, None]) & loss_mask[:, 2:n + 2]
    keys: List[tuple] = []
    steps = []
    feats = hidden[:, :n, head.feature_columns]  # EAGLE: final-norm states; EAGLE-3: the fused aux states
    prev = None  # the previous step's outputs
    for k in range(ttt_steps):
        if k > 0:  # own features from the previous step, shifted right by one position
            feats = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        # query (step k, t) -> step-0 keys at s <= t-k; step-j keys (1 <= j <= k) at s = t-k+j
        # example k = 1, t = 3: step-0 keys 0..2 (committed prefix) and the step-1 key at 3 (itself)
        blocks = [t[None, :] <= (t[:, None] - k)]
        for j in range(1, k + 1):
            blocks.append(t[None, :] == (t[:, None] - k + j))
        mask = torch.cat(blocks, dim=1)[None].expand(bs, n, n * (k + 1))
        mask = mask | (~mask.any(-1, keepdim=True))  # rows with no key (t < k) attend anywhere; never used

        def store(kk, vv):
            keys.append((kk, vv))
            return torch.cat([x for x, _ in keys], dim=2), torch.cat([y for _, y in keys], dim=2)

        prev = head(toks, feats, pos, store, mask)  # [bs, n, hidden]
        keys = keys[: k + 1]
        steps.append((prev, base_ok & (t[None, :] >= k)))
    return steps, hidden[:, 1:n + 1, :_target_width(head)]


def draft_logits(lm_head, feats, d2t: Optional[torch.Tensor] = None, head=None):
    """``[..., hidden]`` -> ``[..., vocab_d]``: the shared target head, restricted to the draft
    vocabulary ``d2t`` ([vocab_d] target ids, FR-Spec token map) when given; an EAGLE-3 ``head``
    scores with its own norm + LM head (its vocabulary is ``d2t``)."""
    if head is not None and head.owns_lm_head:
        return head.logits(feats).float()
    if d2t is None:
        return lm_head(feats).float()
    return torch.nn.functional.linear(feats, lm_head.weight[d2t]).float()


def _device(head) -> torch.device:
    """Where the head's weights live: batches are built on the host and moved there (training on a GPU)."""
    return next(head.parameters()).device


def _target_width(head) -> int:
    """Width of the target's final-norm states at the front of a stored ``[final | aux]`` row."""
    return getattr(head, "target_hidden", head.config.hidden_size)


def step_logits(lm_head, feats, target_hidden, valid, d2t: Optional[torch.Tensor] = None, head=None):
    """Draft ``[M, vocab_d]`` and target ``[M, vocab]`` logits at the valid positions only (M = valid.sum()).

    Training runs the LM head only where a loss is taken (answer tokens), not over the prompt.
    """
    with torch.no_grad():
        tl = lm_head(target_hidden[valid]).float()
    return draft_logits(lm_head, feats[valid], d2t, head), tl


def talf_batch_loss(head, lm_head, seqs, cfg: TrainConfig, d2t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TALF (SALF & TALF Alg. 1) on a batch of (tokens, hidden, loss_mask, tree) items: mean CE over the
    root and every target-tree node; the LM head runs only at nodes that take a loss."""
    dev = _device(head)
    tok, hid, msk, lens = batch_sequences(seqs, cfg.max_len, dev)
    n = tok.shape[1] - 2
    ntok, npar, nhid, has = (x.to(dev) for x in batch_trees(seqs, n, cfg.max_len))
    f0, ok, levels = talf_forward(head, tok, hid, msk, lens, ntok, npar, has)
    has = has & ok
    draft = torch.cat([f0[ok], levels[has].flatten(0, -2)])  # [nodes, hidden]
    with torch.no_grad():
        target = lm_head(torch.cat([hid[:, 1:n + 1, :_target_width(head)][ok], nhid[has].flatten(0, -2)])).float()
    return talf_loss(target, draft_logits(lm_head, draft, d2t, head),
                     torch.ones(draft.shape[0], dtype=torch.bool, device=dev), d2t)


def _loss(cfg: TrainConfig, lm_head, steps, target_hidden, d2t=None, head=None) -> torch.Tensor:
    """Multi-step loss. Every step's target at position t is the same p_t and step k's valid positions
    are a subset of step 0's (``base_ok & t >= k``), so the full-vocabulary target head runs once, on
    step 0's positions, and each step indexes its rows: ``valid_k[valid_0]`` picks them in order.
    Example: valid_0 = [F, T, T, T], valid_1 = [F, F, T, T] -> valid_1[valid_0] = [F, T, T]."""
    fn = LOSSES[cfg.loss]
    v0 = steps[0][1]
    with torch.no_grad():
        tl0 = lm_head(target_hidden[v0]).float()  # [M0, vocab]
    losses = []
    for feats, valid in steps:
        losses.append(fn(tl0[valid[v0]], draft_logits(lm_head, feats[valid], d2t, head), None, cfg, d2t))
    return multi_step_loss(losses, cfg.gamma)


@torch.no_grad()
def evaluate_alpha(head, lm_head, seqs, cfg: TrainConfig, d2t: Optional[torch.Tensor] = None) -> List[float]:
    """Mean acceptance alpha per draft position (TTT step) over held-out sequences (against the full
    target distribution: with a token map, the mass outside it counts as rejected)."""
    sums, counts = [0.0] * cfg.ttt_steps, [0] * cfg.ttt_steps
    for i in range(0, len(seqs), cfg.batch_size):
        tok, hid, msk, lens = batch_sequences(seqs[i:i + cfg.batch_size], cfg.max_len, _device(head))
        steps, th = ttt_forward(head, tok, hid, msk, lens, cfg.ttt_steps)
        for k, (feats, valid) in enumerate(steps):
            dl, tl = step_logits(lm_head, feats, th, valid, d2t, head)
            sums[k] += float(acceptance_rate(tl, dl, d2t).sum())
            counts[k] += int(valid.sum())
    return [s / max(c, 1) for s, c in zip(sums, counts)]


def train_draft(head, lm_head, train_seqs, cfg: TrainConfig, eval_seqs: Optional[Sequence] = None,
                on_eval: Optional[Callable] = None, progress: bool = True,
                d2t: Optional[torch.Tensor] = None, state_path: Optional[str] = None) -> List[dict]:
    """Optimise ``head`` (the target's ``lm_head`` stays frozen); returns the log of evaluations.

    ``d2t`` ([vocab_d] target ids) trains a reduced-vocabulary draft (losses per LK §4.4).
    ``state_path``: resumable training. At every evaluation the head, optimiser, scheduler, data
    order and RNG states are written there (atomically); a later call with the same path and
    config continues from the last saved step and ends where an uninterrupted run would."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    head.train()
    for p in list(lm_head.parameters()) + ([head.embed.weight] if head.embed is not None else []):
        p.requires_grad_(False)  # the target's embedding and LM head are shared and frozen
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 *
                                              (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    log = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc=f"train {cfg.loss}", unit="step")
    order: List[int] = []
    start = 0
    if state_path is not None and os.path.isfile(state_path):
        st = torch.load(state_path, weights_only=False)
        if st["config"] != vars(cfg):
            raise ValueError(f"{state_path} was written with another config ({st['config']}); use a new --out "
                             f"or delete it")
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        order, log, start = st["order"], st["log"], st["step"]
        if bar is not None:
            bar.update(start)
    for step in range(start, cfg.steps):
        if len(order) < cfg.batch_size:
            order += rng.sample(range(len(train_seqs)), len(train_seqs))
        idx, order = order[:cfg.batch_size], order[cfg.batch_size:]
        batch = [train_seqs[i] for i in idx]
        if cfg.loss == "talf":
            loss = talf_batch_loss(head, lm_head, batch, cfg, d2t)
        else:
            tok, hid, msk, lens = batch_sequences(batch, cfg.max_len, _device(head))
            loss = _loss(cfg, lm_head, *ttt_forward(head, tok, hid, msk, lens, cfg.ttt_steps), d2t=d2t, head=head)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        if bar is not None:
            bar.set_postfix(loss=f"{loss.item():.4f}")
            bar.update(1)
        if eval_seqs and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            head.eval()
            entry = {"step": step + 1, "loss": loss.item(),
                     "alpha": evaluate_alpha(head, lm_head, eval_seqs, cfg, d2t)}
            if on_eval is not None:
                entry.update(on_eval(head) or {})
            log.append(entry)
            head.train()
            if state_path is not None:
                torch.save({"config": vars(cfg), "step": step + 1, "head": head.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                            "order": order, "log": log}, state_path + ".tmp")
                os.replace(state_path + ".tmp", state_path)
    if bar is not None:
        bar.close()
    head.eval()
    return log

