"""Self-distillation data: prompts answered by the target itself, stored with its hidden states.

On disk (one directory): ``manifest.json`` and ``shard-XXXXX.safetensors`` files, each holding
``tokens`` [n_tok] int32 (prompt + answer, concatenated), ``hidden`` [n_tok, hidden] float16 (the
target's final-norm hidden state at every position), ``loss_mask`` [n_tok] bool (answer tokens)
and ``offsets`` [n_seq + 1] int64. For an EAGLE-3 head, ``hidden`` is ``[n_tok, hidden * 4]``: the final-norm
state followed by the three captured layers (:func:`restate_distill_data`, from a finished directory's tokens
without generating again). Generation is batched, shows a progress bar and is resumable:
the manifest lists finished prompt ids and a rerun skips them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import torch

from ..engine.kv_cache import prefill

__all__ = ["DistillShard", "target_hidden", "generate_distill_data", "restate_distill_data", "load_shards",
           "iter_sequences", "disk_usage", "write_manifest", "heldout_flags", "split_roles", "captured_layers"]

MANIFEST = "manifest.json"


@dataclass
class DistillShard:
    tokens: torch.Tensor  # [n_tok] int32
    hidden: torch.Tensor  # [n_tok, hidden] float16
    loss_mask: torch.Tensor  # [n_tok] bool
    offsets: torch.Tensor  # [n_seq + 1] int64

    def sequences(self) -> Iterator[tuple]:
        for i in range(len(self.offsets) - 1):
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            yield self.tokens[a:b].long(), self.hidden[a:b], self.loss_mask[a:b]


@torch.inference_mode()
def target_hidden(model, seqs: Sequence[Sequence[int]]) -> List[torch.Tensor]:
    """Final-norm hidden states of the target at every position: one batched causal forward.

    Returns one ``[len_i, hidden]`` float32 tensor per sequence (``[len_i, hidden * 4]`` with the
    model's EAGLE-3 ``aux_layers`` set: final-norm states, then the captured layers).
    """
    _, _, h, _ = prefill(model, seqs, max(len(s) for s in seqs))
    return [h[b, :len(s)].float() for b, s in enumerate(seqs)]


def _manifest(out_dir: str) -> dict:
    path = os.path.join(out_dir, MANIFEST)
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return {"format": "treespec-distill-v1", "done": [], "shards": [], "tokens": 0, "answer_tokens": 0}


def write_manifest(path: str, man: dict) -> None:
    """Replace ``path`` atomically (write a temporary file, then rename): an interrupted run keeps the
    previous manifest, which is what makes generation resumable."""
    with open(path + ".tmp", "w") as f:
        json.dump(man, f)
    os.replace(path + ".tmp", path)


def disk_usage(out_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))


def generate_distill_data(engine, prompt_ids: Sequence[str], prompts: Sequence[str], out_dir: str, *,
                          max_new_tokens: int = 128, batch_size: int = 8, temperature: float = 0.0,
                          seed: int = 0, progress: bool = True) -> dict:
    """Answer ``prompts`` with the engine's target (plain decoding) and store hidden states.

    Resumable: prompts whose id is already in the manifest are skipped. Returns the manifest.
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    man = _manifest(out_dir)
    done = set(man["done"])
    todo = [(i, p) for i, p in zip(prompt_ids, prompts) if i not in done]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), unit="prompt", desc="distill")
    for start in range(0, len(todo), batch_size):
        chunk = todo[start:start + batch_size]
        ids = engine.encode([p for _, p in chunk])
        res = engine.generate([list(x) for x in ids], max_new_tokens=max_new_tokens, policy=None,
                              temperature=temperature, seed=seed + start)
        seqs = [x + r.token_ids for x, r in zip(ids, res)]
        hidden = target_hidden(engine.target, seqs)
        tokens = torch.cat([torch.tensor(s, dtype=torch.int32) for s in seqs])
        mask = torch.cat([torch.tensor([False] * len(x) + [True] * len(r.token_ids)) for x, r in zip(ids, res)])
        offsets = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
        name = f"shard-{len(man['shards']):05d}.safetensors"
        save_file({"tokens": tokens, "hidden": torch.cat(hidden).half().cpu(), "loss_mask": mask, "offsets": offsets},
                  os.path.join(out_dir, name))
        man["shards"].append(name)
        man["done"] += [i for i, _ in chunk]
        man["tokens"] += int(tokens.numel())
        man["answer_tokens"] += int(mask.sum())
        man["bytes"] = disk_usage(out_dir)
        write_manifest(os.path.join(out_dir, MANIFEST), man)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return man


@torch.inference_mode()
def restate_distill_data(model, src_dir: str, out_dir: str, batch_size: int = 8, progress: bool = True) -> dict:
    """Copy ``src_dir``'s sequences to ``out_dir`` with the states ``model`` returns now (set
    ``model.aux_layers`` for EAGLE-3's ``[final | aux]`` rows): one prefill per ``batch_size`` sequences,
    no generation. Resumable shard by shard. Returns the new manifest."""
    from safetensors.torch import load_file, save_file

    src = _manifest(src_dir)
    os.makedirs(out_dir, exist_ok=True)
    man = _manifest(out_dir)
    if not man["shards"]:
        man.update({k: src[k] for k in ("format", "done", "tokens", "answer_tokens")}, shards=[],
                   aux_layers=list(getattr(model, "aux_layers", ())))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(src["shards"]), initial=len(man["shards"]), unit="shard", desc="restate")
    for name in src["shards"][len(man["shards"]):]:
        t = load_file(os.path.join(src_dir, name))
        off = t["offsets"].tolist()
        seqs = [t["tokens"][a:b].long().tolist() for a, b in zip(off[:-1], off[1:])]
        hidden = []
        for i in range(0, len(seqs), batch_size):
            hidden += target_hidden(model, seqs[i:i + batch_size])
        save_file({**t, "hidden": torch.cat(hidden).half().cpu()}, os.path.join(out_dir, name))
        man["shards"].append(name)
        man["bytes"] = disk_usage(out_dir)
        write_manifest(os.path.join(out_dir, MANIFEST), man)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return man


def load_shards(out_dir: str) -> List[DistillShard]:
    from safetensors.torch import load_file

    man = _manifest(out_dir)
    if not man["shards"]:
        raise FileNotFoundError(f"{out_dir}: no distillation shards (run `treespec train data` first)")
    out = []
    for name in man["shards"]:
        t = load_file(os.path.join(out_dir, name))
        if "hidden" not in t:  # tokens only (the shipped data): the target's states are made from them here
            raise ValueError(f"{out_dir}/{name}: tokens without the target's hidden states; make them with "
                             f"`treespec train states --data {out_dir} --out DIR` and use DIR")
        out.append(DistillShard(t["tokens"], t["hidden"], t["loss_mask"], t["offsets"]))
    return out


def captured_layers(out_dir: str) -> List[int]:
    """The target layers whose states ``out_dir`` stores beside the final ones (``treespec train states``: an
    EAGLE-3 head's ``aux_layers``); ``[]`` for plain states (``treespec train data``)."""
    return [int(x) for x in _manifest(out_dir).get("aux_layers") or ()]


def split_roles(out_dir: str, every: int) -> List[str]:
    """Per stored sequence: ``"test"`` (held out: index within its prompt set ``% every == 0``, what
    ``treespec bench --every`` measures), ``"val"`` (``% every == every // 2``: the validation prompts
    the acceptance table is measured on, ``PromptSet.every(every, every // 2)``) or ``"train"``.
    Example, every 10: indices 0, 10, 20 test; 5, 15 val; the rest train."""
    seen: dict = {}
    roles = []
    for pid in _manifest(out_dir)["done"]:
        name = pid.split("/", 1)[0]
        i = seen.get(name, 0)
        roles.append("test" if i % every == 0 else "val" if every > 1 and i % every == every // 2 else "train")
        seen[name] = i + 1
    return roles


def heldout_flags(out_dir: str, every: int) -> List[bool]:
    """Per stored sequence: held out iff its position *within its prompt set* is a multiple of
    ``every`` (ids look like ``humaneval/HumanEval/3``), matching ``treespec bench --every``."""
    seen: dict = {}
    flags = []
    for pid in _manifest(out_dir)["done"]:
        name = pid.split("/", 1)[0]
        flags.append(seen.get(name, 0) % every == 0)
        seen[name] = seen.get(name, 0) + 1
    return flags


def iter_sequences(shards: Sequence[DistillShard], ids: Optional[Sequence[int]] = None):
    """All (tokens [T], hidden [T, H], loss_mask [T]) sequences, optionally a subset by index."""
    seqs = [s for sh in shards for s in sh.sequences()]
    return seqs if ids is None else [seqs[i] for i in ids]
