"""The engine's buffers keep the model's dtype: the target's and the draft's KV caches from prefill on, and the
tree expander's per-node KV and feature buffers (a float32 buffer in a bf16 run would double its memory and
round its values differently from the model's own KV)."""

import pytest
import torch

from tests.engines import POLICIES, prompts
from tests.models.tiny import make_tiny_llama
from treespec_sglang.engine import SpecEngine
from treespec_sglang.engine.expander import TreeExpander


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def typed_engine(request, tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-" + request.param)
    make_tiny_llama(path, vocab=64, hidden=48, layers=2, heads=4, kv_heads=2)
    return SpecEngine.from_pretrained(str(path), draft=None, seed=0, dtype=request.param)


def test_prefill_fills_a_cache_of_the_models_dtype(typed_engine):
    with torch.no_grad():
        cache, inp, hidden, lens, logits = typed_engine.calls.prefill([[1, 2, 3], [4]], 16)
    assert cache.k.dtype == cache.v.dtype == typed_engine.dtype
    assert cache.k.shape == (2, 2, 2, 16, 12) and cache.max_len == 16
    assert lens.tolist() == [3, 1] and inp.tolist() == [[1, 2, 3], [4, 0, 0]] and hidden.dtype == typed_engine.dtype


def test_the_tree_expanders_buffers_keep_the_models_dtype(typed_engine, monkeypatch):
    seen = []
    real = TreeExpander.__call__

    def spy(self, *a, **k):
        out = real(self, *a, **k)
        seen.append((self.tk.dtype, self.tv.dtype, self.feat.dtype))
        return out

    monkeypatch.setattr(TreeExpander, "__call__", spy)
    typed_engine.generate(prompts(2, seed=4), max_new_tokens=4, policy=POLICIES[0])
    assert seen and set(seen) == {(typed_engine.dtype,) * 3}
