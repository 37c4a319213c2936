"""``bench/profile_round.py``: every component it times is still where the engine calls it (a renamed engine
method left the script failing at its first patch), the rows add up to the generation's time, and the engine is
as it was after."""

import pytest

from bench.profile_round import profile

COMPONENTS = {"verify forward", "target LM head", "draft forward", "draft LM head", "tree build", "verify walk",
              "KV commit", "other"}


def test_every_component_is_timed_and_the_engine_is_restored(tiny_engine):
    engine = tiny_engine
    before = {name: getattr(engine.calls, name) for name in ("logits", "draft_logprobs")}
    plain = engine.generate([[5, 6, 7]], max_new_tokens=6, policy=None)[0].token_ids
    r = profile(engine, [[5, 6, 7], [8, 9]], {"policy": "talon", "budget": 6, "topk": 3}, 6)
    assert r["rounds"] > 0 and r["tokens"] == sum(len(o.token_ids) for o in r["out"])
    assert COMPONENTS <= {k for k, v in r["ms_per_round"].items() if v > 0}  # each one was reached and timed
    total_ms = sum(r["ms_per_round"].values()) * r["rounds"]
    assert total_ms <= 1e3 * r["wall_s"] * 1.01 and total_ms >= 0.5e3 * r["wall_s"]  # exclusive: no double count
    assert r["out"][0].token_ids == plain  # lossless while patched
    assert {name: getattr(engine.calls, name) for name in before} == before
    assert "logits" not in vars(engine.calls) and "forward" not in vars(engine.target)


def test_a_component_that_moved_fails_loudly(tiny_engine, monkeypatch):
    monkeypatch.delattr(type(tiny_engine.calls), "draft_logprobs")
    with pytest.raises(AttributeError):
        profile(tiny_engine, [[5, 6, 7]], {"policy": "talon", "budget": 6, "topk": 3}, 2)
