"""`treespec bench` end to end on a tiny model directory (the real demo runs in the slow tests)."""

import json

import pytest

from tests.helpers import needs_demo
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
    from treespec_sglang.engine.calls import ModelCalls

    monkeypatch.setattr(ModelCalls, "encode_one", lambda self, i, p, chat=True: [3, 4, 5])
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


def _tiny_distill(tmp_path, layers=1):
    """A tiny target at tmp_path/tiny and 8 distilled random prompts at tmp_path/d."""
    import torch

    from tests.engines import IdsEngine
    from treespec_sglang.engine import SpecEngine
    from treespec_sglang.training.data import generate_distill_data

    tiny = tmp_path / "tiny"
    make_tiny_llama(tiny, vocab=48, hidden=32, layers=layers)
    e = SpecEngine.from_pretrained(str(tiny), draft=None, dtype="float32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 48, (4,), generator=g).tolist() for _ in range(8)]
    generate_distill_data(IdsEngine(e), [f"humaneval/{i}" for i in range(8)], prompts, str(tmp_path / "d"),
                          max_new_tokens=8, batch_size=4, progress=False)
    return tiny


def test_train_draft_cli_writes_sglang_checkpoint_and_log(tmp_path):
    from treespec_sglang.models import EagleDraftHead

    tiny = _tiny_distill(tmp_path)
    out = tmp_path / "ck"
    assert main(["train", "draft", "--target", str(tiny), "--data", str(tmp_path / "d"), "--loss", "lk-lambda",
                 "--steps", "4", "--batch-size", "2", "--eval-every", "2", "--heldout-every", "4",
                 "--eval-prompts", "2", "--out", str(out)]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert [e["step"] for e in log["log"]] == [2, 4] and log["heldout_sequences"] == 2
    assert all(len(e["alpha"]) == 3 and e["tau"] >= 1.0 for e in log["log"])
    EagleDraftHead.load(str(out))  # SGLang-format checkpoint


def test_train_vocab_trees_and_talf_with_token_map_cli(tmp_path):
    import torch

    from treespec_sglang.engine import SpecEngine

    tiny = _tiny_distill(tmp_path)
    common = ["--target", str(tiny), "--data", str(tmp_path / "d")]
    assert main(["train", "vocab", *common, "--size", "20", "--heldout-every", "4", "--out", str(tmp_path / "tm.pt")]) == 0
    tm = torch.load(tmp_path / "tm.pt")
    assert len(tm) == 20 and len(set(tm)) == 20
    assert main(["train", "trees", *common, "--topk", "2", "--depth", "3", "--out", str(tmp_path / "trees")]) == 0
    out = tmp_path / "ck"
    assert main(["train", "draft", *common, "--loss", "talf", "--trees", str(tmp_path / "trees"), "--token-map",
                 str(tmp_path / "tm.pt"), "--steps", "2", "--batch-size", "2", "--eval-every", "2",
                 "--heldout-every", "4", "--eval-prompts", "2", "--out", str(out)]) == 0
    assert torch.load(out / "token_map.pt") == tm
    e2 = SpecEngine.from_pretrained(str(tiny), draft=str(out), dtype="float32")
    assert e2.token_map.tolist() == tm
    assert json.loads((out / "train_log.json").read_text())["log"][-1]["tau"] >= 1.0


def test_train_states_then_eagle3_kl_and_talf_cli(tmp_path):
    """EAGLE-3 from the command line: restated data (final + 3 captured layers), a fresh head over the token
    map, a TALF fine-tune from it; the checkpoint loads as EAGLE-3 with its map and decodes losslessly."""
    import torch

    from treespec_sglang.engine import SpecEngine
    from treespec_sglang.models import Eagle3DraftHead, load_draft_head
    from treespec_sglang.training.data import iter_sequences, load_shards

    tiny = _tiny_distill(tmp_path, layers=8)
    common = ["--target", str(tiny), "--heldout-every", "4", "--eval-every", "2", "--eval-prompts", "2",
              "--batch-size", "2", "--steps", "2"]
    assert main(["train", "vocab", "--target", str(tiny), "--data", str(tmp_path / "d"), "--size", "20",
                 "--heldout-every", "4", "--out", str(tmp_path / "tm.pt")]) == 0
    assert main(["train", "states", "--target", str(tiny), "--data", str(tmp_path / "d"),
                 "--out", str(tmp_path / "d3")]) == 0
    seqs = iter_sequences(load_shards(str(tmp_path / "d3")))
    assert len(seqs) == 8 and seqs[0][1].shape[-1] == 4 * 32
    with pytest.raises(SystemExit, match="--arch eagle3 needs --token-map"):
        main(["train", "draft", "--arch", "eagle3", "--data", str(tmp_path / "d3"), *common,
              "--out", str(tmp_path / "x")])
    out = tmp_path / "e3"
    assert main(["train", "draft", "--arch", "eagle3", "--data", str(tmp_path / "d3"), "--token-map",
                 str(tmp_path / "tm.pt"), *common, "--out", str(out)]) == 0
    head = load_draft_head(str(out))
    tm = torch.load(tmp_path / "tm.pt")
    assert isinstance(head, Eagle3DraftHead) and head.hot_ids.tolist() == tm and head.aux_layers == (2, 4, 5)
    assert main(["train", "trees", "--target", str(tiny), "--data", str(tmp_path / "d"), "--topk", "2",
                 "--depth", "3", "--out", str(tmp_path / "trees")]) == 0
    talf = tmp_path / "e3-talf"
    assert main(["train", "draft", "--loss", "talf", "--init", str(out), "--data", str(tmp_path / "d3"),
                 "--trees", str(tmp_path / "trees"), *common, "--out", str(talf)]) == 0
    e = SpecEngine.from_pretrained(str(tiny), draft=str(talf), dtype="float32")
    assert e.token_map.tolist() == tm and e.target.aux_layers == (2, 4, 5)
    ids = [[3, 9, 4], [17, 22]]
    plain = [r.token_ids for r in e.generate(ids, max_new_tokens=8, policy=None)]
    assert [r.token_ids for r in e.generate(ids, max_new_tokens=8, policy={"policy": "talon", "budget": 6})] == plain


@pytest.mark.slow
@needs_demo
def test_demo_defaults_to_the_shipped_eagle3_head_and_plans_from_its_table(capsys):
    """`treespec demo` with its defaults loads the EAGLE-3 head, plans every policy's budget from the
    acceptance table beside it, accepts drafts (tau > 1) and stays lossless in float32."""
    rc = main(["demo", "--humaneval", "1", "--mtbench", "1", "--max-new-tokens", "24", "--no-peers",
               "--dtype", "float32", "--policies", "eagle2,chain"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "draft demo-eagle3" in out and "no policy_table.json" not in out, out
    assert "budgets: per policy" in out and out.count("acceptance table tau") == 2, out
    rows = [line.split() for line in out.splitlines() if line.startswith(("eagle2", "chain"))]
    assert len(rows) == 2, out
    for row in rows:  # label, tok/s, tau, delta, tree, speedup, lossless ("yes ...")
        i = row.index("yes")
        assert float(row[i - 4]) > 1.2, row  # tau: the head drafts what the target accepts
