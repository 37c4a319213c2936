"""``training.data``: the distillation shards' loader."""

import pytest
import torch

from treespec_sglang.training.data import load_shards


def test_tokens_without_states_are_refused_by_name(tmp_path):
    """A shard of tokens only (as the shipped data stores them) names the shard and the command that makes the
    states, where a bare ``KeyError: 'hidden'`` came from deep in the loader."""
    from safetensors.torch import save_file

    from treespec_sglang.training.data import MANIFEST, write_manifest

    save_file({"tokens": torch.arange(6, dtype=torch.int32), "loss_mask": torch.ones(6, dtype=torch.bool),
               "offsets": torch.tensor([0, 6])}, str(tmp_path / "shard-000.safetensors"))
    write_manifest(str(tmp_path / MANIFEST), {"format": "treespec-distill-v1", "done": ["p/0"],
                                              "shards": ["shard-000.safetensors"], "tokens": 6, "answer_tokens": 6})
    with pytest.raises(ValueError, match=r"shard-000.safetensors: tokens without the target's hidden states; make "
                                         r"them with `treespec train states --data .* --out DIR`"):
        load_shards(str(tmp_path))
