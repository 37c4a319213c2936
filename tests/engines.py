"""Shared builders for the reference-engine tests: tiny engines, prompts, the draft chain oracle, training helpers."""

import torch

from tests.models.tiny import make_tiny_llama
from treespec_sglang.engine import KVCache, SpecEngine
from treespec_sglang.models import LlamaModel
from treespec_sglang.training.data import generate_distill_data
from treespec_sglang.training.trainer import evaluate_alpha, train_draft

POLICIES = [
    {"policy": "eagle2", "budget": 10, "topk": 3, "depth": 3},
    {"policy": "talon", "budget": 12, "topk": 4, "mu": 0.05},
    {"policy": "salf", "budget": 10, "batch": 3, "th": 0.3},
    {"policy": "c2t", "budget": 10, "topk": 4, "beta": 0.2},
    {"policy": "chain", "length": 4},
    {"policy": "chain", "length": 4, "beta": 0.3},
]


class Tokenizer:
    """A tokenizer stand-in that only names its EOS id (or None)."""

    def __init__(self, eos_token_id):
        self.eos_token_id = eos_token_id


class ChatTokenizer(Tokenizer):
    """Text -> ids: ``[len(text)]`` plainly, ``[1, 2, len(text)]`` through its chat template."""

    chat_template = "stub"

    def __init__(self):
        super().__init__(None)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize and messages[0]["role"] == "user"
        return [1, 2, len(messages[0]["content"])]

    def __call__(self, text):
        return {"input_ids": [len(text)] if text else []}


def make_aligned_engine(path):
    """A target whose draft is the target itself one layer down: accepts often, exercising
    deep paths and KV compaction (a random head rarely gets past the root)."""
    make_tiny_llama(path, vocab=64, hidden=48, layers=1, heads=4, kv_heads=2, seed=1)
    e = SpecEngine.from_pretrained(str(path), draft=None, seed=0, dtype="float32")
    # the unfused layer (the engine fuses its target's q/k/v and gate/up; the draft keeps separate weights)
    layer = LlamaModel.from_pretrained(str(path)).model.layers[0]
    with torch.no_grad():  # draft = the target's own layer on fc(embed) (ignores the feature)
        H = e.draft.config.hidden_size
        e.draft.fc.weight.zero_()
        e.draft.fc.weight[:, :H] = torch.eye(H)
        e.draft.fc.bias.zero_()
        e.draft.layers[0].load_state_dict({k: v for k, v in layer.state_dict().items() if "input_layernorm" not in k},
                                          strict=False)
        e.draft.layers[0].input_layernorm = layer.input_layernorm
    return e


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def chain_draft(e, tokens, feats):
    """Run the draft over pairs at positions 1..m with a plain causal mask; return [m, hidden]."""
    m = len(tokens)
    cfg = e.draft.config
    cache = KVCache(1, 1, cfg.num_key_value_heads, m + 1, cfg.head_dim, torch.float32, "cpu")
    pos = torch.arange(1, m + 1)[None]
    col = torch.arange(m + 1)[None, None, :]
    mask = (col >= 1) & (col <= pos[:, :, None])
    out = e.draft(torch.tensor([tokens]), torch.stack(feats)[None], pos, cache.stores(pos, m + 1)[0], mask)
    return out[0]


def distill_random_prompts(e, out_dir, n=24, seed=0, vocab=48, max_new_tokens=16):
    """Self-distillation data for ``n`` random 5-token prompts of the tiny target (ids = "0".."n-1")."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (5,), generator=g).tolist() for _ in range(n)]
    return generate_distill_data(IdsEngine(e), [str(i) for i in range(n)], prompts, str(out_dir),
                                 max_new_tokens=max_new_tokens, batch_size=8, progress=False)


def alpha_before_after(e, train, held, cfg, d2t=None):
    """Held-out alpha per position of a fresh seeded head, before and after ``train_draft``."""
    head = type(e.draft).for_target(e.target.config, seed=1).attach(e.target.model.embed_tokens)
    before = evaluate_alpha(head, e.target.lm_head, held, cfg, d2t)
    return before, train_draft(head, e.target.lm_head, train, cfg, eval_seqs=held, progress=False, d2t=d2t)[-1]["alpha"]


class IdsEngine:
    """The tiny model has no tokenizer: prompts are token-id lists already."""

    def __init__(self, e):
        self.e, self.target = e, e.target

    def encode(self, prompts):
        return [list(p) for p in prompts]

    def generate(self, *a, **k):
        return self.e.generate(*a, **k)
