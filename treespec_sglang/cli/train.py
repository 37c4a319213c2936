"""``treespec train data|draft``: self-distillation data and draft-head training."""

from __future__ import annotations

import argparse
import json
import os

from .runs import int_at_least, set_threads

__all__ = ["add_parser"]

DEVICE_HELP = "where the target (and the head) run: cpu, or cuda to train on a GPU"


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="self-distillation data and draft-head training")
    tsub = p.add_subparsers(dest="what", required=True)
    d = tsub.add_parser("data", help="answer prompts with the target and store its hidden states (resumable)")
    d.add_argument("--target", default="smollm2-135m")
    d.add_argument("--prompts", default="humaneval,mtbench")
    d.add_argument("--limit", type=int_at_least(1), default=None, help="first N prompts of each set")
    d.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
    d.add_argument("--batch-size", type=int_at_least(1), default=8)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--threads", type=int_at_least(1), default=None)
    d.add_argument("--dtype", default="auto", help="target dtype: auto (bf16 where the CPU has AMX / AVX512-BF16), "
                                                   "float32, bfloat16")
    d.add_argument("--device", default="cpu", help=DEVICE_HELP)
    d.add_argument("--out", default="data/distill")
    d.set_defaults(fn=run_data)
    r = tsub.add_parser("trees", help="TALF: the target's EAGLE-2 beam tree at every loss position (resumable)")
    r.add_argument("--target", default="smollm2-135m")
    r.add_argument("--data", default="data/distill")
    r.add_argument("--topk", type=int_at_least(1), default=4, help="beam width k (SALF & TALF App. D: 4)")
    r.add_argument("--depth", type=int_at_least(1), default=3, help="tree levels, root included (App. D: 3)")
    r.add_argument("--threads", type=int_at_least(1), default=None)
    r.add_argument("--device", default="cpu", help=DEVICE_HELP)
    r.add_argument("--out", default="data/talf-trees")
    r.set_defaults(fn=run_trees)
    v = tsub.add_parser("vocab", help="a reduced draft vocabulary (token map) from the distillation data")
    v.add_argument("--target", default="smollm2-135m")
    v.add_argument("--data", default="data/distill")
    v.add_argument("--size", type=int_at_least(1), default=8192)
    v.add_argument("--heldout-every", type=int_at_least(3), default=10)
    v.add_argument("--out", default="checkpoints/token_map.pt")
    v.set_defaults(fn=run_vocab)
    st = tsub.add_parser("states", help="EAGLE-3: recompute stored sequences' target states with the three "
                                        "captured layers (one prefill per batch, no generation; resumable)")
    st.add_argument("--target", default="smollm2-135m")
    st.add_argument("--data", default="data/distill")
    st.add_argument("--batch-size", type=int_at_least(1), default=8)
    st.add_argument("--threads", type=int_at_least(1), default=None)
    st.add_argument("--dtype", default="float32", help="target dtype (the states are stored as float16)")
    st.add_argument("--device", default="cpu", help=DEVICE_HELP)
    st.add_argument("--out", default="data/distill-eagle3")
    st.set_defaults(fn=run_states)
    t = tsub.add_parser("draft", help="train an EAGLE or EAGLE-3 draft head (SGLang format checkpoints)")
    t.add_argument("--arch", default="eagle", choices=["eagle", "eagle3"],
                   help="head to start from when --init is not given (eagle3 needs --token-map and "
                        "`treespec train states` data)")
    t.add_argument("--target", default="smollm2-135m")
    t.add_argument("--data", default="data/distill")
    t.add_argument("--loss", default="kl", choices=["kl", "lk-alpha", "lk-lambda", "talf"])
    t.add_argument("--trees", default="data/talf-trees", help="TALF only: `treespec train trees` output")
    t.add_argument("--token-map", default=None,
                   help="train a reduced-vocabulary draft over these target ids (`treespec train vocab`); "
                        "copied into the output as token_map.pt (SGLang: --speculative-token-map)")
    t.add_argument("--init", default=None, help="start from this draft directory (default: seeded random)")
    t.add_argument("--steps", type=int_at_least(1), default=200)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--batch-size", type=int_at_least(1), default=4)
    t.add_argument("--ttt-steps", type=int_at_least(1), default=3)
    t.add_argument("--gamma", type=float, default=0.8)
    t.add_argument("--eta", type=float, default=3.0)
    t.add_argument("--max-len", type=int_at_least(2), default=384)
    t.add_argument("--heldout-every", type=int_at_least(3), default=10,
                   help="hold out every N-th sequence (index %% N == 0) for evaluation")
    t.add_argument("--eval-every", type=int_at_least(1), default=50)
    t.add_argument("--eval-policy", default='{"policy": "eagle2", "budget": 16, "topk": 4, "depth": 4}',
                   help="policy (JSON) for the periodic held-out tau measured through the engine")
    t.add_argument("--eval-prompts", type=int_at_least(0), default=4, help="held-out prompts for that tau (0 = skip)")
    t.add_argument("--seed", type=int_at_least(0), default=0)
    t.add_argument("--threads", type=int_at_least(1), default=None)
    t.add_argument("--resume", action="store_true",
                   help="continue from <out>/train_state.pt (written at every --eval-every) if it exists")
    t.add_argument("--dtype", default="float32", help="the target's dtype while training (the head trains in float32)")
    t.add_argument("--device", default="cpu", help=DEVICE_HELP)
    t.add_argument("--config", default=None,
                   help="JSON file with any of the flags above (parsed as they are; one given here wins)")
    t.add_argument("--out", default="checkpoints/draft")
    t.set_defaults(fn=run_draft, draft_actions=t._actions)  # --config reads its flags as they parse
    c = tsub.add_parser("c2t", help="collect C2T node data with a draft head and train the classifier")
    c.add_argument("--target", default="smollm2-135m")
    c.add_argument("--draft", default="demo")
    c.add_argument("--prompts", default="humaneval,mtbench")
    c.add_argument("--every", type=int_at_least(1), default=1, help="use prompts whose index %% N == 0")
    c.add_argument("--offset", type=int_at_least(0), default=0, help="... or (index + offset) %% N == 0")
    c.add_argument("--limit", type=int_at_least(1), default=None)
    c.add_argument("--topk", type=int_at_least(1), default=4)
    c.add_argument("--depth", type=int_at_least(1), default=4)
    c.add_argument("--max-new-tokens", type=int_at_least(1), default=64)
    c.add_argument("--batch-size", type=int_at_least(1), default=8)
    c.add_argument("--hidden", type=int_at_least(1), default=48)
    c.add_argument("--epochs", type=int_at_least(1), default=10)
    c.add_argument("--neg-per-pos", type=float, default=1.0, help="negatives sampled per positive each epoch")
    c.add_argument("--samples", default=None, help="reuse (or save) the collected node samples at this .pt path")
    c.add_argument("--threads", type=int_at_least(1), default=None)
    c.add_argument("--dtype", default="auto", help="engine dtype (auto: bf16 where the CPU runs it natively)")
    c.add_argument("--out", default="checkpoints/c2t.pt")
    c.set_defaults(fn=run_c2t)


def run_data(a: argparse.Namespace) -> int:
    from ..data import load_prompt_set
    from ..engine import SpecEngine
    from ..training.data import generate_distill_data

    set_threads(a.threads)
    engine = SpecEngine.from_pretrained(a.target, draft=None, dtype=a.dtype, device=a.device)
    print(f"dtype {engine.dtype_note}", flush=True)  # stdout: an error after it stays one line
    ids, prompts = [], []
    for name in [x.strip() for x in a.prompts.split(",") if x.strip()]:
        ps = load_prompt_set(name).take(a.limit)
        ids += [f"{name}/{i}" for i in ps.ids]
        prompts += ps.prompts
    man = generate_distill_data(engine, ids, prompts, a.out, max_new_tokens=a.max_new_tokens,
                                batch_size=a.batch_size, temperature=a.temperature)
    print(f"{a.out}: {len(man['done'])} sequences, {man['tokens']} tokens ({man['answer_tokens']} answer), "
          f"{man.get('bytes', 0) / 2**20:.1f} MiB on disk")
    return 0


def run_trees(a: argparse.Namespace) -> int:
    import time

    from ..engine.loading import resolve_target
    from ..models import LlamaModel
    from ..training.talf import generate_talf_trees

    set_threads(a.threads)
    t0 = time.time()
    model = LlamaModel.from_pretrained(resolve_target(a.target)).to(a.device)  # float32: trees are its argmaxes
    man = generate_talf_trees(model, a.data, a.out, topk=a.topk, depth=a.depth)
    print(f"{a.out}: {man['nodes']} target-tree nodes (k={a.topk}, depth={a.depth}), "
          f"{man.get('bytes', 0) / 2**20:.1f} MiB on disk, {time.time() - t0:.0f} s")
    return 0


def _split(data: str, every: int, seqs):
    """(training, held-out test) sequences; the validation ones (``split_roles``) are in neither."""
    from ..training.data import split_roles

    roles = split_roles(data, every)
    train = [s for s, r in zip(seqs, roles) if r == "train"]
    if not train:  # a map or a head from nothing (train vocab wrote a map of the lowest ids)
        raise ValueError(f"--data {data} with --heldout-every {every} leaves no training sequence")
    return train, [s for s, r in zip(seqs, roles) if r == "test"]


def run_states(a: argparse.Namespace) -> int:
    from ..engine.loading import resolve_target
    from ..engine.dtypes import resolve_dtype
    from ..models import LlamaModel
    from ..models.eagle3_head import default_aux_layers
    from ..training.data import restate_distill_data

    set_threads(a.threads)
    dtype = resolve_dtype(a.dtype, a.device)
    model = LlamaModel.from_pretrained(resolve_target(a.target), dtype=dtype).to(a.device)
    model.aux_layers = default_aux_layers(model.config.num_hidden_layers)
    man = restate_distill_data(model, a.data, a.out, batch_size=a.batch_size)
    print(f"{a.out}: {len(man['done'])} sequences, target states [final | layers {list(model.aux_layers)}], "
          f"{man.get('bytes', 0) / 2**20:.1f} MiB on disk")
    return 0


def run_vocab(a: argparse.Namespace) -> int:
    from ..engine.loading import resolve_target, save_token_map
    from ..models.llama import LlamaConfig
    from ..training.data import iter_sequences, load_shards
    from ..training.vocab import build_token_map, coverage

    cfg = LlamaConfig.from_dir(resolve_target(a.target))
    train, held = _split(a.data, a.heldout_every, iter_sequences(load_shards(a.data)))
    tm = build_token_map(train, a.size, cfg.vocab_size, always=cfg.eos_ids)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    save_token_map(tm, a.out)
    print(f"{a.out}: {a.size} of {cfg.vocab_size} target ids; answer-token coverage train "
          f"{coverage(train, tm):.4f}, held-out {coverage(held, tm):.4f}")
    return 0


def run_draft(a: argparse.Namespace) -> int:
    import torch

    from ..engine import SpecEngine
    from ..engine.loading import TOKEN_MAP, read_token_map, save_token_map
    from ..training.data import iter_sequences, load_shards
    from ..training.trainer import TrainConfig, train_draft

    if a.config:
        _apply_config(a, a.config)
    eval_policy = _eval_policy(a.eval_policy)  # checked before any model loads
    set_threads(a.threads)
    torch.manual_seed(a.seed)
    if a.arch == "eagle3" and not a.init:
        engine = _eagle3_engine(a)
    else:
        engine = SpecEngine.from_pretrained(a.target, draft=a.init, seed=a.seed, dtype=a.dtype, fuse=False,
                                            device=a.device)
    print(f"dtype {engine.dtype_note}", flush=True)  # stdout: an error after it stays one line
    _check_head(a, engine.draft)
    if a.token_map and not engine.draft.owns_lm_head:
        engine.set_token_map(read_token_map(a.token_map))
    d2t = engine.token_map  # from --token-map, or the --init draft's own token_map.pt
    seqs = iter_sequences(load_shards(a.data))
    if a.loss == "talf":
        from ..training.talf import load_trees

        trees = load_trees(a.trees)
        if len(trees) != len(seqs):
            raise SystemExit(f"--trees {a.trees} holds {len(trees)} sequences, --data {a.data} {len(seqs)}: "
                             f"rerun `treespec train trees --data {a.data} --out {a.trees}`")
        seqs = [s + (tr,) for s, tr in zip(seqs, trees)]
    train, held = _split(a.data, a.heldout_every, seqs)
    cfg = TrainConfig(loss=a.loss, steps=a.steps, lr=a.lr, batch_size=a.batch_size, ttt_steps=a.ttt_steps,
                      gamma=a.gamma, eta=a.eta, max_len=a.max_len, seed=a.seed, eval_every=a.eval_every)
    os.makedirs(a.out, exist_ok=True)
    if d2t is not None:  # the checkpoint directory carries its map (engine and SGLang read it from there)
        save_token_map(d2t, os.path.join(a.out, TOKEN_MAP))

    eval_prompts = [seq[0][:int(seq[2].long().argmax())].tolist() for seq in held[:a.eval_prompts]
                    if bool(seq[2].any())]

    def checkpoint(head):
        head.save(a.out, dtype=torch.bfloat16)
        if not eval_prompts:
            return {}
        res = engine.generate(eval_prompts, max_new_tokens=32, policy=eval_policy)  # engine.draft is `head`
        failed = [r.error for r in res if r.error]
        if failed:  # never a tau of 1.0 from requests that did not run
            raise RuntimeError(f"--eval-policy: {len(failed)} of {len(res)} held-out requests failed: {failed[0]}")
        acc = [x for r in res for x in r.stats.accepted]
        return {"tau": 1.0 + sum(acc) / max(len(acc), 1), "tau_policy": eval_policy}

    log = train_draft(engine.draft, engine.target.lm_head, train, cfg, eval_seqs=held, on_eval=checkpoint, d2t=d2t,
                      state_path=os.path.join(a.out, "train_state.pt") if a.resume else None)
    with open(os.path.join(a.out, "train_log.json"), "w") as f:
        json.dump({"config": vars(cfg), "log": log, "train_sequences": len(train), "heldout_sequences": len(held)},
                  f, indent=2)
    last = log[-1] if log else {}
    print(f"{a.out}: loss {last.get('loss', float('nan')):.4f}, held-out alpha per position "
          f"{[round(x, 3) for x in last.get('alpha', [])]}, held-out tau {last.get('tau', float('nan')):.3f}")
    return 0


def _apply_config(a: argparse.Namespace, path: str) -> None:
    """``--config``: a JSON object of ``train draft``'s flags (``"lr"`` or ``"--lr"``), each parsed as its flag is;
    a flag given on the command line wins over the file. An unknown key or a value its flag would refuse is a
    ValueError naming both (a typo was ignored; a string ``lr`` failed mid-run)."""
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"--config {path}: must be a JSON object of train draft's flags, got {type(cfg).__name__}")
    actions = {act.dest: act for act in a.draft_actions if act.dest not in ("help", "config", "fn")}
    for key, value in cfg.items():
        dest = str(key).lstrip("-").replace("-", "_")
        act = actions.get(dest)
        if act is None:
            raise ValueError(f"--config {path}: unknown key {key!r}; allowed: {sorted(actions)}")
        if getattr(a, dest) != act.default:
            continue  # given on the command line
        if isinstance(act, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} must be true or false, got {json.dumps(value)}")
        elif value is not None:
            if isinstance(value, (bool, dict, list)):
                raise ValueError(f"--config {path}: {key} must be a {act.type.__name__ if act.type else 'string'}, "
                                 f"got {json.dumps(value)}")
            try:  # through the flag's own type (int_at_least, float, str) and choices
                value = (act.type or str)(str(value))
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise ValueError(f"--config {path}: {key}: {e}") from None
            if act.choices is not None and value not in act.choices:
                raise ValueError(f"--config {path}: {key} must be one of {list(act.choices)}, got {value!r}")
        setattr(a, dest, value)


def _eval_policy(raw: str) -> dict:
    """``--eval-policy`` parsed and validated as a request's policy (a bad one gave tau 1.0 for a whole run)."""
    from ..policies import parse_spec

    spec = json.loads(raw)
    try:
        parse_spec(spec)
    except ValueError as e:
        raise ValueError(f"--eval-policy: {e}") from None
    return spec


def _check_head(a: argparse.Namespace, head) -> None:
    """The head against ``--arch``, ``--token-map`` and ``--data``'s states: an EAGLE --init under --arch eagle3
    trained an EAGLE head, a token map beside an EAGLE-3 head (its own) was ignored, and states of the wrong
    layers trained on the wrong features (or failed in a matmul)."""
    from ..models import Eagle3DraftHead
    from ..training.data import captured_layers

    eagle3 = isinstance(head, Eagle3DraftHead)
    if a.arch == "eagle3" and not eagle3:
        raise ValueError(f"--arch eagle3 with --init {a.init}: that head is an EAGLE head; drop --init or --arch")
    if eagle3 and a.init and a.token_map:
        raise ValueError(f"--token-map with --init {a.init}: an EAGLE-3 head carries its own token map")
    want = list(head.aux_layers or ()) if eagle3 else []
    got = captured_layers(a.data)
    if got != want:
        need = (f"EAGLE-3 states of target layers {want} (`treespec train states`)" if eagle3
                else "plain states (`treespec train data`)")
        raise ValueError(f"--data {a.data} holds states of target layers {got or 'none (plain)'}; this head needs "
                         f"{need}")


def _eagle3_engine(a: argparse.Namespace):
    """A training engine around a fresh EAGLE-3 head over ``--token-map``'s ids, its LM head
    initialised from the target's rows (what EAGLE-3 training starts from)."""
    from ..engine import SpecEngine
    from ..engine.dtypes import explain_dtype, resolve_dtype
    from ..engine.loading import load_models, read_token_map
    from ..models import Eagle3DraftHead

    if not a.token_map:
        raise SystemExit("--arch eagle3 needs --token-map (the draft vocabulary: `treespec train vocab`)")
    dtype, note = resolve_dtype(a.dtype, a.device), explain_dtype(a.dtype, a.device)
    target, _, tok, _ = load_models(a.target, None, dtype=dtype, seed=a.seed)
    head = Eagle3DraftHead.for_target(target.config, read_token_map(a.token_map), target.lm_head.weight,
                                      target.model.norm.weight, seed=a.seed)
    return SpecEngine(target, head, tok, device=a.device, dtype=dtype, fuse=False, dtype_note=note)


def run_c2t(a: argparse.Namespace) -> int:
    import torch

    from ..data import load_prompt_set
    from ..engine import SpecEngine
    from ..training.c2t import collect_c2t_samples, train_c2t

    set_threads(a.threads)
    engine = SpecEngine.from_pretrained(a.target, draft=None if a.draft == "random" else a.draft, dtype=a.dtype)
    print(f"dtype {engine.dtype_note}", flush=True)  # stdout: an error after it stays one line
    if a.samples and os.path.isfile(a.samples):
        blob = torch.load(a.samples)
        feats, labels = blob["features"], blob["labels"]
    else:
        prompts = []
        for name in [x.strip() for x in a.prompts.split(",") if x.strip()]:
            prompts += load_prompt_set(name).every(a.every, a.offset).take(a.limit).prompts
        feats, labels = collect_c2t_samples(engine, prompts, topk=a.topk, depth=a.depth,
                                            max_new_tokens=a.max_new_tokens, batch_size=a.batch_size)
        if a.samples:
            torch.save({"features": feats, "labels": labels}, a.samples)
    clf, report = train_c2t(feats, labels, hidden=a.hidden, epochs=a.epochs, neg_per_pos=a.neg_per_pos)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    clf.save(a.out)
    with open(os.path.splitext(a.out)[0] + "_report.json", "w") as f:
        json.dump(report, f, indent=2)
    print(f"{a.out}: {len(labels)} nodes, positive rate {report['positive_rate']:.3f}; held-out recall "
          f"{report['recall']:.3f} keeping {report['kept_rate']:.3f} of nodes (beta {report['beta']})")
    for r in report["buckets"]:
        print(f"  entropy {r['entropy']:>12}: nodes {r['nodes']:6d} accepted {r['accepted']:5d} "
              f"recall {r['recall']:.3f} kept {r['kept_rate']:.3f}")
    return 0
