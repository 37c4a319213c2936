"""The draft head's token map under TP (:func:`treespec_sglang.plugin.ranks.shard_hot_head`): each rank holds its
shard of the hot rows, over the group SGLang splits the LM head's vocabulary on; alone or without a map, SGLang's
own call. The multi-rank case runs in spawned processes over a gloo group (``tests.helpers.run_ranks``)."""

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import GlooGroup, run_ranks
from treespec_sglang.plugin import ranks as R


# ------------------------------------------------------------------------------------------ token map under TP
@pytest.mark.parametrize("n_hot,size", [(8, 2), (7, 2), (9, 4), (5, 1)])
def test_hot_rows_split_the_hot_ids_in_rank_order(n_hot, size):
    hot = torch.randperm(100, generator=torch.Generator().manual_seed(n_hot))[:n_hot]
    parts = [R.hot_rows(100, hot, r, size).tolist() for r in range(size)]
    flat = [x for p in parts for x in p]
    s = -(-n_hot // size)
    assert all(len(p) == s for p in parts)
    assert flat[:n_hot] == hot.tolist() and set(flat[n_hot:]) <= {int(hot[-1])}
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        R.hot_rows(50, torch.tensor([3, 50]), 0, size)


@pytest.mark.parametrize("hot,ok", [([0], True), ([0, 49], True), ([], False), ([-1, 3], False), ([49, 50], False)])
def test_hot_rows_take_every_id_of_the_vocabulary_and_refuse_the_rest(hot, ok):
    """Ids 0 and vocab - 1 are the edges of the valid range (a map of one id too); an empty map, a negative id and
    one past the vocabulary are refused with the range."""
    if ok:
        assert R.hot_rows(50, torch.tensor(hot), 0, 1).tolist() == hot
        return
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 50\), got"):
        R.hot_rows(50, torch.tensor(hot, dtype=torch.int64), 0, 1)


V, H, HIDDEN = 12, 5, 4  # target vocab, hot ids, hidden


def _fake_draft_worker(rank, world, full, hot, calls):
    shard = full.shape[0] // world
    head = torch.nn.Parameter(full[rank * shard:(rank + 1) * shard].clone())  # this rank's vocab-parallel shard
    model = SimpleNamespace(set_embed_and_head=lambda e, h: calls.append(("set", e, h)))
    return SimpleNamespace(hot_token_id=hot, speculative_algorithm=SimpleNamespace(is_eagle3=lambda: False),
                           _resolve_shared_embed_and_head=lambda: ("embed", head), draft_runner=SimpleNamespace(model=model),
                           target_worker=SimpleNamespace(model_runner=SimpleNamespace(
                               model_config=SimpleNamespace(vocab_size=V))))


def _head_main(rank, out):
    full = torch.randn(V, HIDDEN, generator=torch.Generator().manual_seed(0))  # [vocab, hidden], same on both
    hot = torch.tensor([11, 0, 7, 3, 6])
    calls = []
    worker = _fake_draft_worker(rank, 2, full, hot, calls)
    R._head_group = GlooGroup  # the spawned process's own module: this rank's gloo world
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    R.logger.addHandler(handler)
    R.logger.setLevel(logging.INFO)
    R.shard_hot_head(lambda self: calls.append(("original",)), worker)
    (_, embed, head), = calls
    torch.save({"full": full, "head": head.data, "hot": worker.hot_token_id, "embed": embed, "logs": logs},
               os.path.join(out, f"rank{rank}.pt"))


def test_under_tp_each_rank_holds_its_shard_of_the_hot_head_rows(tmp_path):
    """Gathered rank by rank (as SGLang's logits processor does), the draft logits over the shards equal
    the single-rank hot head's: ``full[hot] @ x``, then the padded tail repeating the last hot id."""
    run_ranks(_head_main, 2, tmp_path, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))
    full, hot = r0["full"], [11, 0, 7, 3, 6]
    x = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(0))
    gathered = torch.cat([r0["head"] @ x, r1["head"] @ x])  # [world * ceil(H / world)] = [6]
    ids = r0["hot"].tolist()
    assert ids == r1["hot"].tolist() == hot + [6]
    assert torch.equal(torch.cat([r0["head"], r1["head"]]), full[ids])  # the shards are full's rows, bit for bit
    # a matrix-vector product and a row's dot product sum in another order (float32: 1e-7 apart on a Zen 4 EPYC)
    torch.testing.assert_close(gathered, torch.stack([full[t] @ x for t in ids]))
    assert r0["embed"] == "embed"
    assert r0["logs"] == r1["logs"] == ["treespec: TP 2, token map of 5 ids: this rank's draft head holds 3 hot rows"]


def test_alone_or_without_a_token_map_sglang_sets_the_head(monkeypatch):
    """SGLang's own call, with its arguments as given: alone, without a token map (None or no attribute), for
    EAGLE-3 (its own head), and for a target whose head SGLang does not share."""
    calls = []
    full = torch.randn(V, HIDDEN)

    def original(self, *args, **kwargs):
        calls.append((self, args, kwargs))
        return "sglang's"

    workers = []
    monkeypatch.setattr(R, "_head_group", lambda: SimpleNamespace(world_size=1))
    workers.append(_fake_draft_worker(0, 1, full, torch.tensor([1]), []))
    assert R.shard_hot_head(original, workers[-1], 3, device="cpu") == "sglang's"
    monkeypatch.setattr(R, "_head_group", lambda: SimpleNamespace(world_size=2))
    workers.append(_fake_draft_worker(0, 1, full, None, []))
    workers.append(SimpleNamespace(**{k: v for k, v in vars(workers[-1]).items() if k != "hot_token_id"}))
    workers.append(_fake_draft_worker(0, 1, full, torch.tensor([1]), []))
    workers[-1].speculative_algorithm = SimpleNamespace(is_eagle3=lambda: True)
    workers.append(_fake_draft_worker(0, 1, full, torch.tensor([1]), []))
    workers[-1]._resolve_shared_embed_and_head = lambda: ("embed", None)
    for w in workers[1:]:
        assert R.shard_hot_head(original, w, 3, device="cpu") == "sglang's"
    assert len(calls) == len(workers) and all(c[0] is w for c, w in zip(calls, workers))
    assert all(c[1:] == ((3,), {"device": "cpu"}) for c in calls)


@pytest.mark.sglang
@pytest.mark.parametrize("dp_lm_head", [False, True])
def test_the_hot_head_is_sharded_over_the_group_the_lm_head_is(monkeypatch, dp_lm_head):
    """With ``--enable-dp-lm-head`` SGLang splits the LM heads' vocabulary over the attention TP group (and
    gathers the draft's logits there), else over the TP group: the hot rows are gathered and sharded over it."""
    pytest.importorskip("sglang")
    import sglang.srt.runtime_context as rc

    parallel = SimpleNamespace(tp_group=object(), attn_tp_group=object(), enable_dp_lm_head=dp_lm_head)
    monkeypatch.setattr(rc, "get_parallel", lambda: parallel)
    assert R._head_group() is (parallel.attn_tp_group if dp_lm_head else parallel.tp_group)
