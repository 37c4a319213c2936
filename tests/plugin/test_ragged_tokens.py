"""Ragged verify, counted at the attention op: the tokens each request actually runs through attention
equal its draft tree's size (a chain verify, causal), or the batch's widest tree's size (a tree verify: the
compiled CPU extend kernel takes a tree mask only over one extend length for the whole batch).

:func:`ragged_verify_forward` runs with a stand-in runner whose attention backend mirrors SGLang
0.5.23's ``IntelAMXAttnBackend`` (metadata built once per forward by ``_build_extend_metadata``, wrapped by
the plugin's :func:`amx_extend_metadata` as the hook does; ``forward_extend`` calls the extend op). The op
is instrumented: per call it reads each request's query rows from its own inputs (``extend_seq_lens``,
``extend_start_loc``, ``seq_lens`` and ``q_extend`` as received) and decodes which verify slot each row
came from. The oracle is each request's draft tree as drafted (its node count, and the slots it was
spread over in SGLang's padded ``[bs, N]`` layout), never the keep mask's own sums.
"""

import random
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import random_tree_lists
from treespec_sglang.plugin.cpu.attention import extend_attention_cpu
from treespec_sglang.plugin.ragged import amx_extend_metadata, amx_forward_metadata, ragged_verify_forward
from treespec_sglang.plugin.ragged_support import ENV_RAGGED

H, D, SLOTS = 2, 32, 512  # head size: a multiple of 32, as the compiled op requires


def padded_verify_batch(seed, sizes, n, chain=False):
    """SGLang's padded verify layout of random draft trees of ``sizes`` nodes: each tree's nodes spread over
    ``n`` slots in index order (the root at slot 0, filler between and after), a QLEN_ONLY mask
    (ancestors-or-self; filler rows see the root and themselves) and a random prefix per request.

    Returns (trees as (tokens, parents) lists, ``slots[b]`` the slot of each real node, keep ``[bs, n]``,
    mask ``[bs * n * n]``, prefix lengths). ``chain``: each tree a chain over the first slots (a topk-1 verify,
    whose filler only ever follows the kept nodes)."""
    rng = random.Random(seed)
    trees, slots, prefix = [], [], []
    keep = torch.zeros(len(sizes), n, dtype=torch.bool)
    mask = torch.zeros(len(sizes), n, n, dtype=torch.bool)
    for b, size in enumerate(sizes):
        tokens, parents = random_tree_lists(rng, size, vocab=50)
        where = [0] + sorted(rng.sample(range(1, n), size - 1))
        if chain:
            parents, where = [-1] + list(range(size - 1)), list(range(size))
        trees.append((tokens, parents))
        slots.append(where)
        for i in range(n):
            mask[b, i, i] = mask[b, i, 0] = True
        for i, s in enumerate(where):
            keep[b, s] = True
            j = i
            while j >= 0:  # ancestors-or-self
                mask[b, s, where[j]] = True
                j = parents[j]
        prefix.append(rng.randrange(1, 9))
    return trees, slots, keep, mask.reshape(-1), prefix


class CountingOp:
    """The extend attention op (torch stand-in) with a record of what each call received: per request the
    verify slots of its query rows, decoded from ``q_extend`` (each row is the embedding of its input id,
    ``b * N + slot``), and its prefix length ``seq_lens - extend_seq_lens``."""

    def __init__(self, emb, n):
        self.emb, self.n, self.calls = emb, n, []

    def __call__(self, q, k, v, o, k_buf, v_buf, ks, vs, r2t, rpi, seq_lens, ext, start, *rest):
        hits = (q.reshape(q.shape[0], -1)[:, None, :] == self.emb[None]).all(-1)  # [T, bs * N]
        assert hits.sum(-1).eq(1).all(), "a query row that is no input id's embedding"
        ids = hits.float().argmax(-1).tolist()
        per_req = []
        for b in range(len(ext)):
            lo, hi = int(start[b]), int(start[b]) + int(ext[b])
            per_req.append(dict(rows=hi - lo, req=[i // self.n for i in ids[lo:hi]],
                                slots=[i % self.n for i in ids[lo:hi]], prefix=int(seq_lens[b] - ext[b])))
        self.calls.append(dict(total=q.shape[0], per_req=per_req, mask_numel=None if rest[-2] is None
                               else rest[-2].numel()))
        return extend_attention_cpu(q, k, v, o, k_buf, v_buf, ks, vs, r2t, rpi, seq_lens, ext, start, *rest)


class IntelAMXAttnBackend:
    """Named like SGLang's backend (the plugin picks its ragged path by class name); its two methods follow
    SGLang 0.5.23's for a target verify, with ``_build_extend_metadata`` wrapped by the plugin's hook body."""

    def __init__(self, op, n, k_buf, v_buf, r2t):
        self.op, self.n, self.k_buf, self.v_buf, self.r2t = op, n, k_buf, v_buf, r2t

    def _sglang_build_extend_metadata(self, fb):  # every request extends by N tokens
        bs = fb.batch_size
        tree = fb.spec_info.custom_mask if fb.spec_info.tree_topk != 1 else None
        return (fb.seq_lens + self.n, torch.full((bs,), self.n, dtype=torch.int32),
                torch.arange(0, bs * self.n, self.n, dtype=torch.int32), tree)

    def init_forward_metadata(self, fb):  # SGLang's: (attn_logits, max_extend_len = N) for a target verify ...
        self.extend_metadata = amx_extend_metadata(IntelAMXAttnBackend._sglang_build_extend_metadata, self, fb)
        self.forward_metadata = (None, self.n)
        amx_forward_metadata(None, self, fb)  # ... with the plugin's AFTER hook

    def forward_extend(self, q, k, v, fb):
        self.k_buf[fb.out_cache_loc], self.v_buf[fb.out_cache_loc] = k, v  # SGLang's set_kv_buffer
        seq_lens, ext, start, tree = self.extend_metadata
        o = torch.empty_like(q)
        _, max_len = self.forward_metadata
        self.op(q, k, v, o, self.k_buf, self.v_buf, 1.0, 1.0, self.r2t, fb.req_pool_indices, seq_lens, ext, start,
                max_len, D ** -0.5, 0.0, False, 0, None, None, tree, True)
        return o


def model_forward(weights):
    """A two-layer stand-in for ``ModelRunner.forward``: every layer's queries are the input ids' embeddings
    (the op's record decodes them), keys and values come from the previous layer's output."""
    emb, wk, wv, wo = weights

    def forward(runner, fb):
        runner.attn_backend.init_forward_metadata(fb)  # as ModelRunner.forward does (no skip_attn_backend_init)
        x = emb[fb.input_ids]  # [T, H * D]
        q = x.view(-1, H, D)
        for _ in range(2):
            o = runner.attn_backend.forward_extend(q, (x @ wk).view(-1, H, D), (x @ wv).view(-1, H, D), fb)
            x = o.reshape(x.shape)
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=x @ wo, hidden_states=x))
    return forward


def run_verify(seed, sizes, n, ragged, topk=4):
    """One target verify of the batch through :func:`ragged_verify_forward` (``ragged`` False: the plugin
    runs it padded). Returns (the op's record, the recorded tokens per request, logits ``[bs * N, V]``)."""
    trees, slots, keep, mask, prefix = padded_verify_batch(seed, sizes, n, chain=topk == 1)
    bs = len(sizes)
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(bs * n, H * D, generator=g)
    weights = (emb, torch.randn(H * D, H * D, generator=g) * 0.3, torch.randn(H * D, H * D, generator=g),
               torch.randn(H * D, 11, generator=g))
    op = CountingOp(emb, n)
    perm = torch.randperm(SLOTS, generator=g)
    r2t = torch.full((bs, 64), SLOTS - 1, dtype=torch.int32)  # request b's tokens: prefix, then its N slots
    for b in range(bs):
        r2t[b, :prefix[b] + n] = perm[b * 32:b * 32 + prefix[b] + n].int()
    k_buf, v_buf = torch.randn(SLOTS, H, D, generator=g), torch.randn(SLOTS, H, D, generator=g)
    runner = SimpleNamespace(attn_backend=IntelAMXAttnBackend(op, n, k_buf, v_buf, r2t))
    fb = SimpleNamespace(
        batch_size=bs, input_ids=torch.arange(bs * n), seq_lens=torch.tensor(prefix),
        positions=torch.cat([torch.arange(n) + p for p in prefix]), req_pool_indices=torch.arange(bs),
        out_cache_loc=torch.cat([r2t[b, prefix[b]:prefix[b] + n] for b in range(bs)]).long(),
        forward_mode=SimpleNamespace(is_target_verify=lambda: True),
        spec_info=SimpleNamespace(custom_mask=mask, tree_topk=topk, draft_token_num=n))
    runner.attn_backend.init_forward_metadata(fb)  # SGLang plans the padded batch before the forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_RAGGED, "1" if ragged else "0")
        out, recorded = ragged_verify_forward(model_forward(weights), runner, fb, keep)
    assert fb.input_ids.shape[0] == bs * n  # the batch's fields are restored after the forward
    return trees, slots, prefix, op.calls, recorded, out.logits_output.next_token_logits


CASES = [([5, 1, 3, 6], 6), ([1, 1], 4), ([8], 8), ([2, 7, 4], 9)]


def verified_slots(slots, n, width):
    """Request b's verified slots: its real nodes in index order, then (a tree verify at the batch's one
    ``width``) its first filler slots in index order."""
    fill = [s for s in range(n) if s not in slots]
    return slots + fill[: max(width - len(slots), 0)] if width else slots


@pytest.mark.parametrize("topk", [4, 1])
@pytest.mark.parametrize("sizes, n", CASES)
def test_tokens_reaching_attention_per_request_equal_the_tree_size(sizes, n, topk):
    trees, slots, prefix, calls, recorded, _ = run_verify(sum(sizes) * 7 + n, sizes, n, ragged=True, topk=topk)
    own = [len(tokens) for tokens, _ in trees]  # each request's tree as drafted
    width = max(own) if topk > 1 else None  # a tree verify: every request at the widest tree's size
    want = [width or k for k in own]
    assert len(calls) == 2  # one op call per layer
    for call in calls:
        assert call["total"] == sum(want)
        assert [r["rows"] for r in call["per_req"]] == want
        for b, r in enumerate(call["per_req"]):
            assert r["req"] == [b] * want[b]  # request b's rows hold its own tokens ...
            if width == n:  # nothing to compact: SGLang's padded batch, in index order
                assert r["slots"] == list(range(n))
            else:  # ... its real nodes in index order (and at one width, its first fillers)
                assert r["slots"] == verified_slots(slots[b], n, width)
            assert r["prefix"] == prefix[b]
        assert call["mask_numel"] == (None if topk == 1 else len(sizes) * width * width)
    assert recorded == want  # what the plugin reports as treespec_verify_tokens


@pytest.mark.parametrize("topk", [4, 1])
@pytest.mark.parametrize("sizes, n", CASES)
def test_padded_verify_runs_n_tokens_per_request_and_ragged_logits_match_it(sizes, n, topk):
    seed = sum(sizes) * 7 + n
    trees, slots, _, calls, recorded, padded = run_verify(seed, sizes, n, ragged=False, topk=topk)
    assert recorded == [n] * len(sizes)
    assert all([r["rows"] for r in c["per_req"]] == [n] * len(sizes) for c in calls)
    *_, ragged = run_verify(seed, sizes, n, ragged=True, topk=topk)
    real = [b * n + s for b in range(len(sizes)) for s in slots[b]]
    width = max(sizes) if topk > 1 else None
    ran = {b * n + s for b in range(len(sizes)) for s in verified_slots(slots[b], n, width)}
    torch.testing.assert_close(ragged[real], padded[real], rtol=1e-5, atol=1e-3)  # logits of magnitude ~100
    assert not ragged[[i for i in range(len(sizes) * n) if i not in ran]].any()  # rows not run come back zero
