"""TALF: the target builds a tree at every training position; the draft learns every node of it.

SALF & TALF, Alg. 1 and §3.2. At draft position t the root is x_{t+1} (its next-token law is
p_root = lm_head(h_{t+1}), the ordinary step-0 target). The *target* grows an EAGLE-2 beam from it
(App. D: k = 4, depth 3): level 1 = the k most likely children of the root under the target, level
l >= 2 = the k best of the k^2 children of level l-1 by path probability (EAGLE-2 §4.1). Every node's
child law p_child(n) = lm_head(g_n) comes from a tree-attention forward of the target
(Alg. 1 line 5, "precomputed during tree generation"): we store the node's final-norm hidden g_n.

The draft then follows every path with its own features (HASS-style, Alg. 1 line 6): a level-l
node at position t sees the committed pairs 0..t (step-0 keys), its ancestors' keys and itself,
and is fed its parent's draft output. Loss = mean over all nodes of CE(p_child(n), q_child(n))
(Alg. 1 lines 7-8; the mean is the sum up to the batch's node count). No feature regression (§3.2).

Shapes: ``levels = depth - 1`` tree levels below the root, ``width = k`` nodes per level.
"""

from __future__ import annotations

import json
import os
from typing import List, Sequence

import torch

from ..engine.kv_cache import prefill
from .data import disk_usage, load_shards, write_manifest

__all__ = ["loss_positions", "target_tree", "generate_talf_trees", "load_trees", "batch_trees", "talf_forward", "TREES_MANIFEST"]

TREES_MANIFEST = "trees.json"


def loss_positions(T: int, loss_mask: torch.Tensor) -> torch.Tensor:
    """Draft positions t (0..T-3) that take a loss: ``loss_mask[t + 2]`` (as in ``ttt_forward``). ``[P]`` int64.

    Example: T = 6, loss_mask = [F, F, F, T, T, T] -> [1, 2, 3] (the labels x_3, x_4, x_5)."""
    return torch.nonzero(loss_mask[2:T].bool()).flatten()


@torch.inference_mode()
def target_tree(model, tokens: torch.Tensor, positions: torch.Tensor, topk: int = 4, depth: int = 3,
                chunk: int = 128):
    """Build the target's EAGLE-2 beam tree at each draft position (SALF & TALF Alg. 1 line 2).

    Parameters
    ----------
    model : LlamaModel (the target)
    tokens : ``[T]`` int64, one training sequence
    positions : ``[P]`` int64 draft positions t; the root of tree t is ``tokens[t + 1]``
    topk, depth : beam width k and levels (root included) — App. D uses k = 4, depth = 3

    Returns
    -------
    node_tokens ``[P, depth-1, k]`` int64, node_parent ``[P, depth-1, k]`` int64 (index into the level above;
    0 = the root for level 1), node_hidden ``[P, depth-1, k, hidden]`` float32 (the target's final-norm state at
    each node: its child law is ``lm_head(node_hidden)``).

    Example: k = 2, depth = 3, root children (a: .6, b: .3), a's children (c: .5, d: .4), b's (e: .9, f: .1):
    level 1 = [a, b] with parents [0, 0]; level-2 candidates c .30, d .24, e .27, f .03 -> [c, e], parents [0, 1].
    """
    T, P, k, L = tokens.shape[0], positions.shape[0], topk, depth - 1
    if depth < 2 or k < 1:
        raise ValueError(f"depth must be >= 2 and topk >= 1, got depth={depth}, topk={topk}")
    H = model.config.hidden_size
    if P == 0:
        return (torch.zeros(0, L, k, dtype=torch.long), torch.zeros(0, L, k, dtype=torch.long), torch.zeros(0, L, k, H))
    dev = next(model.parameters()).device  # the model's device (cuda with `train trees --device cuda`)
    positions = positions.to(dev)
    lm_head = model.lm_head
    cache, _, hidden, _ = prefill(model, [tokens.tolist()], T + L * k * min(chunk, max(P, 1)))
    outs = ([], [], [])
    for a in range(0, P, chunk):
        t = positions[a:a + chunk]  # [p]
        p = t.shape[0]
        logv = torch.log_softmax(lm_head(hidden[0, t + 1]).float(), -1)  # [p, vocab] root's child law
        logv, tok = logv.topk(k, dim=-1)  # level 1: [p, k]
        par = torch.zeros(p, k, dtype=torch.long, device=dev)
        anc = torch.empty(p, k, 0, dtype=torch.long, device=dev)  # cache slots of each node's ancestors below the root
        level_tok, level_par, level_hid = [], [], []
        for lvl in range(L):
            if lvl > 0:  # beam step: the best k of the k^2 children by path log-probability
                lp = torch.log_softmax(lm_head(level_hid[-1]).float(), -1)  # [p, k, vocab]
                ctok_lp, ctok = lp.topk(k, dim=-1)  # [p, k, k]
                score = (logv[:, :, None] + ctok_lp).flatten(1)  # [p, k*k]
                logv, flat = score.topk(k, dim=-1)  # [p, k]
                par = flat // k
                tok = ctok.flatten(1).gather(1, flat)
                prev_slots = T + (lvl - 1) * p * k + torch.arange(p, device=dev)[:, None] * k + par  # [p, k]
                anc = torch.cat([anc.gather(1, par[:, :, None].expand(-1, -1, anc.shape[2])),
                                 prev_slots[:, :, None]], dim=2)
            slots = T + lvl * p * k + torch.arange(p * k, device=dev).view(p, k)  # [p, k]
            kv = T + (lvl + 1) * p * k
            col = torch.arange(kv, device=dev)
            # node (t, j) attends the prefix 0..t+1, its ancestors' slots and its own slot
            mask = col <= (t[:, None, None] + 1)
            mask = mask | (col == slots[:, :, None]) | (col[None, None, :, None] == anc[:, :, None, :]).any(-1)
            pos = (t[:, None] + 2 + lvl).expand(p, k)
            g = model(tok.reshape(1, -1), pos.reshape(1, -1), cache.stores(slots.reshape(1, -1), kv),
                      mask.reshape(1, p * k, kv))  # [1, p*k, hidden]
            level_tok.append(tok)
            level_par.append(par)
            level_hid.append(g.view(p, k, -1).float())
        for o, x in zip(outs, (level_tok, level_par, level_hid)):
            o.append(torch.stack(x, dim=1).cpu())  # once per chunk of positions, not per level
    return tuple(torch.cat(o) for o in outs)


def generate_talf_trees(model, data_dir: str, out_dir: str, topk: int = 4, depth: int = 3,
                        progress: bool = True) -> dict:
    """Target trees for every loss position of a distillation directory, one file per shard (resumable).
    Runs on ``model``'s device (``treespec train trees --device cuda``); what is stored is on the host.

    Each ``trees-XXXXX.safetensors`` holds ``node_tokens`` [n_pos, depth-1, k] int32, ``node_parent`` int8,
    ``node_hidden`` [n_pos, depth-1, k, hidden] float16 and ``pos_offsets`` [n_seq + 1] (positions per
    sequence, in ``loss_positions`` order).
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, TREES_MANIFEST)
    man = {"format": "treespec-talf-trees-v1", "data": os.path.abspath(data_dir), "topk": topk, "depth": depth,
           "shards": [], "nodes": 0}
    if os.path.isfile(path):
        with open(path) as f:
            man = json.load(f)
        if (man["topk"], man["depth"]) != (topk, depth):
            raise ValueError(f"{out_dir} holds trees with topk={man['topk']} depth={man['depth']}; "
                             f"asked for topk={topk} depth={depth} (use another --out)")
    shards = load_shards(data_dir)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(s.offsets) - 1 for s in shards), unit="seq", desc="talf trees")
    for i, sh in enumerate(shards):
        name = f"trees-{i:05d}.safetensors"
        if name in man["shards"]:
            if bar is not None:
                bar.update(len(sh.offsets) - 1)
            continue
        parts, counts = [], []
        for tok, _, msk in sh.sequences():
            pos = loss_positions(tok.shape[0], msk)
            parts.append(target_tree(model, tok, pos, topk, depth))
            counts.append(pos.shape[0])
            if bar is not None:
                bar.update(1)
        save_file({"node_tokens": torch.cat([p[0] for p in parts]).int(),
                   "node_parent": torch.cat([p[1] for p in parts]).to(torch.int8),
                   "node_hidden": torch.cat([p[2] for p in parts]).half(),
                   "pos_offsets": torch.tensor([0] + counts).cumsum(0)}, os.path.join(out_dir, name))
        man["shards"].append(name)
        man["nodes"] += sum(counts) * (depth - 1) * topk
        man["bytes"] = disk_usage(out_dir)
        write_manifest(path, man)
    if bar is not None:
        bar.close()
    return man


def load_trees(out_dir: str) -> List[tuple]:
    """Per sequence (in distillation order): (node_tokens, node_parent, node_hidden) as stored."""
    from safetensors.torch import load_file

    path = os.path.join(out_dir, TREES_MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{out_dir}: no TALF trees (run `treespec train trees` first)")
    with open(path) as f:
        man = json.load(f)
    out = []
    for name in man["shards"]:
        t = load_file(os.path.join(out_dir, name))
        off = t["pos_offsets"].tolist()
        for a, b in zip(off[:-1], off[1:]):
            out.append((t["node_tokens"][a:b], t["node_parent"][a:b], t["node_hidden"][a:b]))
    return out


def batch_trees(seqs: Sequence[tuple], n: int, max_len: int):
    """Scatter per-sequence trees (stored at ``loss_positions``) onto the dense draft positions 0..n-1.

    ``seqs``: (tokens [T], hidden, loss_mask [T], (node_tokens [P, levels, width], node_parent, node_hidden)).
    Returns node_tokens [bs, n, levels, width] int64, node_parent (same), node_hidden [bs, n, levels, width,
    hidden] float32, has_tree [bs, n] bool. Positions cut by ``max_len`` are dropped.
    """
    _, _, _, (t0, _, h0) = seqs[0]
    bs, L, k, H = len(seqs), t0.shape[1], t0.shape[2], h0.shape[-1]
    tok = torch.zeros(bs, n, L, k, dtype=torch.long)
    par = torch.zeros(bs, n, L, k, dtype=torch.long)
    hid = torch.zeros(bs, n, L, k, H)
    has = torch.zeros(bs, n, dtype=torch.bool)
    for b, (tokens, _, msk, (nt, np_, nh)) in enumerate(seqs):
        pos = loss_positions(tokens.shape[0], msk)
        keep = pos < min(n, max_len - 2)
        pos = pos[keep]
        tok[b, pos], par[b, pos], hid[b, pos], has[b, pos] = nt[keep].long(), np_[keep].long(), nh[keep].float(), True
    return tok, par, hid, has


def talf_forward(head, tokens, hidden, loss_mask, lens, node_tokens, node_parent, has_tree):
    """The draft over every node of the target trees, level by level with tree attention.

    tokens [bs, T], hidden [bs, T, hidden] (EAGLE-3: [final | aux], the head reads its columns), loss_mask [bs, T], lens [bs]; node_tokens / node_parent
    [bs, n, levels, width] (n = T - 2), has_tree [bs, n]. Returns (root features [bs, n, hidden],
    root valid [bs, n], level features [bs, n, levels, width, hidden]); level l's node (t, j) is fed
    its parent's output and attends step-0 keys s <= t, its ancestors' keys and its own key.
    """
    bs, T = tokens.shape
    n = T - 2
    L, k = node_tokens.shape[2], node_tokens.shape[3]
    dev = tokens.device
    t = torch.arange(n, device=dev)
    keys: List[tuple] = []

    def store(kk, vv):
        keys.append((kk, vv))
        return torch.cat([x for x, _ in keys], dim=2), torch.cat([y for _, y in keys], dim=2)

    ok = (t[None, :] + 2 < lens[:, None]) & loss_mask[:, 2:n + 2]
    mask0 = (t[None, :] <= t[:, None])[None].expand(bs, n, n)
    f0 = head(tokens[:, 1:n + 1], hidden[:, :n, head.feature_columns], (t + 1).expand(bs, n), store, mask0)  # [bs, n, hidden]
    feats, levels = f0[:, :, None], []  # feats: the level above, [bs, n, width_above, hidden]
    anc = torch.empty(bs, n, k, 0, dtype=torch.long, device=dev)  # each node's ancestor index per level (below the root)
    q = torch.arange(n * k, device=dev)
    for lvl in range(L):
        par = node_parent[:, :, lvl]  # [bs, n, k]
        pf = feats.gather(2, par[..., None].expand(-1, -1, -1, feats.shape[-1]))  # parent features [bs, n, k, hidden]
        if lvl > 0:
            anc = torch.cat([anc.gather(2, par[..., None].expand(-1, -1, -1, anc.shape[3])), par[..., None]], dim=3)
        # keys: step-0 [n] | level 0 [n*k] | ... | this level [n*k]; query (t, j) at flat t*k + j
        # example n = 2, k = 2, level 1 query (t=1, j=0) with parent 1: step-0 keys {0, 1}, level-0 key
        # 2 + 1*2 + 1 = 5 (its parent), own key 2 + 4 + 1*2 + 0 = 8
        blocks = [(t[None, :] <= t[:, None])[None, :, None, :].expand(bs, n, k, n)]
        for m in range(lvl):
            same_t = (q // k)[None, None, None, :] == t[None, :, None, None]
            blocks.append(same_t & ((q % k)[None, None, None, :] == anc[:, :, :, m:m + 1]))
        blocks.append((q[None, :] == q[:, None]).view(1, n, k, n * k).expand(bs, -1, -1, -1))
        mask = torch.cat(blocks, dim=3).reshape(bs, n * k, -1)
        pos = (t[:, None] + 2 + lvl).expand(n, k).reshape(1, -1).expand(bs, -1)
        out = head(node_tokens[:, :, lvl].reshape(bs, -1), pf.reshape(bs, n * k, -1), pos, store, mask)
        feats = out.view(bs, n, k, -1)
        levels.append(feats)
    return f0, ok, torch.stack(levels, dim=2) if levels else f0.new_zeros(bs, n, 0, k, f0.shape[-1])
