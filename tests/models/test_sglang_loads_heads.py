"""Our saved EAGLE / EAGLE-3 heads through SGLang 0.5.23's own draft model classes and ``load_weights`` (a
subprocess per head: SGLang's process group and runtime context are per process): every checkpoint tensor lands
in a parameter with its values, and only what SGLang shares from the target stays unloaded. The target has
attention and MLP biases, which SGLang's draft layers lack: its loaders dropped a head's biases without a word."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.models.tiny import make_tiny_llama
from treespec_sglang.models import Eagle3DraftHead, EagleDraftHead, LlamaModel

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")
pytest.importorskip("transformers")

SCRIPT = os.path.join(os.path.dirname(__file__), "sglang_load.py")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("biased-target")
    make_tiny_llama(path, layers=4, attention_bias=True, mlp_bias=True)
    return str(path), LlamaModel.from_pretrained(str(path))


def sglang_load(target_dir, draft_dir, algo, port):
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, SCRIPT, target_dir, draft_dir, algo, str(port)], capture_output=True,
                         text=True, timeout=300, env=env, cwd=os.path.dirname(draft_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_sglang_loads_every_tensor_of_our_head(target, tmp_path, algo):
    path, ours = target
    hot = torch.randperm(ours.config.vocab_size, generator=torch.Generator().manual_seed(1))[:40]
    if algo == "EAGLE":
        head = EagleDraftHead.for_target(ours.config, seed=3)
    else:
        head = Eagle3DraftHead.for_target(ours.config, hot, ours.lm_head.weight, ours.model.norm.weight, seed=3)
    head.save(str(tmp_path / "head"), dtype=torch.float32)
    got = sglang_load(path, str(tmp_path / "head"), algo, 29500 + (os.getpid() % 300) * 2 + (algo == "EAGLE3"))
    assert got["dropped"] == [] and got["differ"] == []
    shared = ["model.embed_tokens.weight"] + (["lm_head.weight"] if algo == "EAGLE" else [])  # the target's
    assert got["unloaded"] == sorted(shared)
    assert got["hot"] == (None if algo == "EAGLE" else hot.tolist())


def test_a_head_with_biases_is_not_saved(target, tmp_path):
    """A head built with biases (an old checkpoint's config) would lose them in SGLang: refused at save."""
    from treespec_sglang.models.llama import LlamaConfig

    _, ours = target
    head = EagleDraftHead(LlamaConfig.from_dict({**ours.config.__dict__, "num_hidden_layers": 1,
                                                 "extra": {}, "attention_bias": True}))
    with pytest.raises(ValueError, match="this draft head has biases .*SGLang's EAGLE / EAGLE-3 draft layers"):
        head.save(str(tmp_path / "biased"))
