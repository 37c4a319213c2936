"""`treespec bench` end to end on a tiny model directory (the real demo runs in the slow tests)."""

import json

import pytest

from tests.models.tiny import make_tiny_llama
from treespec_sglang.cli import main

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")


def test_bench_writes_jsonl_and_plots(tmp_path, monkeypatch):
    from treespec_sglang.data import prompts as P

    tiny = tmp_path / "tiny"
    make_tiny_llama(tiny, vocab=64, hidden=32, layers=1)
    monkeypatch.setitem(P.PROMPT_SETS, "humaneval", lambda: P.PromptSet("humaneval", ["h0", "h1"], ["x", "y"]))
    # the tiny model has no tokenizer: encode every prompt to fixed token ids
    from treespec_sglang.engine import SpecEngine

    monkeypatch.setattr(SpecEngine, "encode", lambda self, ps, chat=True: [[3, 4, 5]] * len(ps))
    out = tmp_path / "out"
    rc = main(["bench", "--target", str(tiny), "--draft", "random", "--prompts", "humaneval",
               "--policies", "eagle2,chain", "--max-new-tokens", "6", "--batch-size", "2", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in open(out / "results.jsonl")]
    summaries = [r for r in rows if r.get("summary")]
    assert [s["policy"].split("(")[0] for s in summaries] == ["plain", "eagle2", "chain"]
    per_req = [r for r in rows if not r.get("summary")]
    assert len(per_req) == 6 and all(r["new_tokens"] == 6 for r in per_req)
    assert (out / "tau_delta.png").stat().st_size > 1000
    assert (out / "acceptance_heatmap.png").stat().st_size > 1000
