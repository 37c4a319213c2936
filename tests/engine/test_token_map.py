"""Reduced draft vocabulary (FR-Spec / SGLang ``--speculative-token-map``): trees hold only mapped
target ids, greedy output is unchanged for every policy, and the map loads from the draft directory."""

import pytest
import torch

from tests.engines import POLICIES, prompts
from tests.models.tiny import make_tiny_llama
from treespec_sglang.engine import SpecEngine
from treespec_sglang.models import EagleDraftHead

pytest.importorskip("transformers")

TOKEN_MAP = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:40]


@pytest.mark.parametrize("spec", POLICIES)
def test_greedy_with_token_map_equals_plain_and_drafts_only_mapped_ids(aligned_engine, spec):
    e = aligned_engine
    ps = prompts(4, seed=3)
    plain = e.generate(ps, max_new_tokens=16, policy=None)
    seen = []
    e.set_token_map(TOKEN_MAP)
    e.observer = lambda tree, ent, res: seen.append(tree.tokens[:, 1:][tree.valid[:, 1:]])
    try:
        specd = e.generate(ps, max_new_tokens=16, policy=spec)
    finally:
        e.set_token_map(None)
        e.observer = None
    assert [r.token_ids for r in specd] == [r.token_ids for r in plain]
    drafted = torch.cat(seen)
    assert drafted.numel() > 0 and torch.isin(drafted, TOKEN_MAP).all()
    assert sum(sum(r.stats.accepted) for r in specd) > 0


def test_draft_logprobs_are_the_target_head_rows(aligned_engine):
    e = aligned_engine
    h = torch.randn(3, e.target.config.hidden_size)
    e.set_token_map(TOKEN_MAP)
    try:
        got = e.calls.draft_logprobs(h)
    finally:
        e.set_token_map(None)
    torch.testing.assert_close(got, torch.log_softmax(e.target.lm_head(h)[:, TOKEN_MAP], -1))
    torch.testing.assert_close(e.calls.draft_logprobs(h), torch.log_softmax(e.target.lm_head(h), -1))


@pytest.mark.parametrize("bad", [[1, 1, 2], [0, 64], [-1, 3], [[1, 2]]])
def test_bad_token_map_names_the_range(aligned_engine, bad):
    with pytest.raises(ValueError, match=r"token_map must be .* in \[0, 63\]"):
        aligned_engine.set_token_map(torch.tensor(bad))
    assert aligned_engine.token_map is None


def test_token_map_loads_from_the_draft_directory(tmp_path):
    make_tiny_llama(tmp_path / "t", vocab=64, hidden=48, layers=1, heads=4, kv_heads=2)
    e = SpecEngine.from_pretrained(str(tmp_path / "t"), draft=None, dtype="float32")
    EagleDraftHead.for_target(e.target.config).save(str(tmp_path / "d"))
    torch.save(TOKEN_MAP.tolist(), tmp_path / "d" / "token_map.pt")  # SGLang's load_token_map format
    e2 = SpecEngine.from_pretrained(str(tmp_path / "t"), draft=str(tmp_path / "d"), dtype="float32")
    assert torch.equal(e2.token_map, TOKEN_MAP)
