"""``SpecEngine``: batched tree speculative decoding on a Llama-family target + EAGLE draft head.

One round for every active request at once: the draft grows each request's tree with its own
policy (:func:`grow_tree`, one draft forward per step for the whole batch), the target verifies
all trees in one forward with tree attention over the per-request KV cache
(:mod:`treespec_sglang.engine.kv_cache`), :func:`verify_tree` accepts a path and a bonus token,
the accepted path's KV is compacted, and the draft consumes the newly committed tokens with the
target's real hidden states (EAGLE's draft extend). Requests finish independently.

Positions: the committed tokens of request b are x_0..x_{L_b}, the root x_{L_b} being the last
(not yet verified) one; the target cache holds x_0..x_{L_b - 1}. The draft cache slot p holds
the pair (target hidden at p - 1, x_p) for p = 1..L_b; a tree node of depth d sits at L_b + d.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence, Union

import torch

from ..policies.calibration import DepthCalibration
from ..verify import sample
from ..models.packing import PackedLinear, pack_linears_, resolve_pack
from .dtypes import explain_dtype, resolve_dtype
from .calls import ModelCalls
from .kv_cache import KVCache
from .round import Batch, RoundOptions, commit, draft, plan, record, verify
from .loading import load_models
from .memory import check_fits, estimate_generate_bytes
from .options import GenerateOptions
from .requests import GenerationResult, RequestStats, admit
from .token_cap import TokenCapPlan

__all__ = ["SpecEngine", "GenerationResult", "RequestStats"]


class _InCalls:
    """An engine attribute that lives in its :class:`ModelCalls` (one copy: the stages read the same object);
    ``setter``: the name of the method that sets it, which makes it read-only here (None: assignable)."""

    def __init__(self, doc: str, setter: Optional[str] = None):
        self.__doc__, self.setter = doc, setter

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, engine, owner=None):
        return self if engine is None else getattr(engine.calls, self.name)

    def __set__(self, engine, value) -> None:
        if self.setter is not None:
            raise AttributeError(f"SpecEngine.{self.name} is read-only: set it with {self.setter}")
        setattr(engine.calls, self.name, value)


class SpecEngine:
    """Reference engine. Build with :meth:`from_pretrained`; run with :meth:`generate`."""

    def __init__(self, target, draft, tokenizer=None, device="cpu", dtype=torch.float32,
                 token_map: Optional[torch.Tensor] = None, fuse: bool = True, dtype_note: Optional[str] = None,
                 pack: Optional[bool] = None):
        target = target.to(device=device, dtype=dtype).eval()
        if fuse:  # the engine only runs the target forward: fused q/k/v and gate/up matmuls
            target.fuse_()
        draft = draft.to(device=device, dtype=dtype).eval().attach(target.model.embed_tokens)
        # the model calls every stage takes (ModelCalls); its draft head and token map: set_token_map, below
        self.calls = ModelCalls(target, draft, None, None, tokenizer, torch.device(device), dtype)
        self._connect_features(target, self.draft)  # the target returns the states the draft reads
        # oneDNN-prepacked linears where the kernel passes its probe (bf16: bit-identical; float32:
        # batch-invariant, ~1.5-2.5x faster small-M linears on AVX2): ``models/packing.py``. Inference
        # only, so not with fuse=False (the training entry points keep plain modules)
        if pack and not fuse:
            raise ValueError("pack=True needs fuse=True (fuse=False keeps plain trainable modules)")
        self.packed, self.pack_note = resolve_pack(pack if fuse else False, dtype, device)
        if self.packed:
            pack_linears_(self.target)
            pack_linears_(self.draft)
        # optional ``observer(tree, parent_entropy, result)`` called after each verify (C2T data)
        self.observer = None
        self.calibration = None  # the last generate(calibrate=True) call's DepthCalibration
        self.cost_curve = None  # this machine's CostCurve (measured_cost_curve, on first use)
        self._batch_curves = {}  # bs > 1 -> (CostCurve, from disk): measured_cost_curve(bs)
        self._cost_from_disk = False
        self.device = torch.device(device)
        self.dtype = dtype
        # "<dtype> (<why>)", e.g. from_pretrained's "float32 (auto: ...)"; the CLI prints it on stdout
        self.dtype_note = dtype_note or explain_dtype(dtype, device)
        cfg = target.config
        self.eos = set(cfg.eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos.add(int(tokenizer.eos_token_id))
        self.set_token_map(token_map)

    # the models, the tokenizer and the draft vocabulary live in ``calls`` (the object the stages take)
    token_map = _InCalls("``[vocab_d]`` target id of each draft id, or None (set with :meth:`set_token_map`)",
                         setter="set_token_map")
    target = _InCalls("The target model.")
    draft = _InCalls("The draft head.")
    tokenizer = _InCalls("The target's tokenizer, or None (token ids only).")

    def set_token_map(self, token_map: Optional[torch.Tensor]) -> None:
        """Restrict the draft to a reduced vocabulary (FR-Spec; SGLang's ``--speculative-token-map``).

        ``token_map`` ``[vocab_d]`` int64: the target ids the draft scores (its LM head = those rows of
        the target's). Trees grow over draft ids and are mapped to target ids before verification, so
        outputs are unchanged (verification reads only target probabilities). None = the full vocabulary.
        """
        if self.draft.owns_lm_head:  # EAGLE-3: the head's own LM head and d2t
            hot = self.draft.hot_ids
            if token_map is not None and not torch.equal(torch.as_tensor(token_map).to(hot), hot):
                raise ValueError("token_map: an EAGLE-3 head carries its own draft vocabulary (d2t); "
                                 "pass no token map, or exactly the head's")
            self.calls.token_map, self.calls.draft_head = hot, self.draft.logits
            return
        w = self.target.lm_head.weight
        if token_map is None:
            self.calls.token_map, self.calls.draft_head = None, self.target.lm_head
            return
        tm = torch.as_tensor(token_map).to(device=self.device, dtype=torch.int64)
        V = self.target.config.vocab_size
        if tm.dim() != 1 or tm.numel() < 1 or int(tm.min()) < 0 or int(tm.max()) >= V or tm.unique().numel() != tm.numel():
            raise ValueError(f"token_map must be a 1-D list of distinct target ids in [0, {V - 1}], "
                             f"got shape {tuple(tm.shape)}")
        head = torch.nn.Linear(w.shape[1], tm.numel(), bias=False, device=self.device, dtype=w.dtype)
        head.weight = torch.nn.Parameter(w.detach()[tm].contiguous(), requires_grad=False)
        self.calls.token_map, self.calls.draft_head = tm, (PackedLinear(head) if self.packed else head)

    @property
    def draft_vocab(self) -> int:
        """How many ids the draft scores: the token map's length, else the target's vocabulary."""
        return self.target.config.vocab_size if self.token_map is None else int(self.token_map.numel())

    @staticmethod
    def _connect_features(target, draft) -> None:
        """Make the target return what the draft reads (``draft.feature_columns`` of its output). EAGLE: the
        final-norm states (``[:hidden]``, the whole output). EAGLE-3: the target also returns the residual
        stream entering the head's ``aux_layers`` (set here; SGLang's default when the checkpoint names none),
        and the head reads those (``[hidden:]``); logits always come from ``[:hidden]``."""
        from ..models.eagle3_head import default_aux_layers

        H = target.config.hidden_size
        if not draft.owns_lm_head:
            target.aux_layers = ()
            return
        if draft.aux_layers is None:
            draft.aux_layers = default_aux_layers(target.config.num_hidden_layers)
        L = target.config.num_hidden_layers
        if draft.target_hidden != H or draft.feature_width != H * len(draft.aux_layers) or \
                not all(0 <= i < L for i in draft.aux_layers):
            raise ValueError(f"EAGLE-3 head reads {len(draft.aux_layers)} x {draft.target_hidden} features from "
                             f"layers {draft.aux_layers}; the target has hidden {H} and {L} layers")
        target.aux_layers = draft.aux_layers

    @classmethod
    def from_pretrained(cls, target: str = "smollm2-135m", draft: Optional[str] = None, device="cpu",
                        dtype="auto", seed: int = 0, fuse: bool = True, pack: Optional[bool] = None) -> "SpecEngine":
        """``target``: a HF Llama-family directory or ``"smollm2-135m"``; ``draft``: an EAGLE
        directory, ``"demo"`` for the shipped head, or None for a seeded random head (tests). A
        ``token_map.pt`` in the draft directory restricts the draft's vocabulary (:meth:`set_token_map`).
        ``dtype``: ``"auto"`` (bf16 where the CPU / GPU runs it natively, else float32:
        :func:`~treespec_sglang.engine.dtypes.resolve_dtype`), a name or a ``torch.dtype``; float32 is
        the bit-exact mode. ``fuse=False`` keeps plain trainable modules (no fused / prepacked
        weights): what ``treespec train draft`` needs, since it trains ``engine.draft``. ``pack``: None
        prepacks the linears where oneDNN passes its probe, False never, True requires it
        (:func:`~treespec_sglang.models.packing.resolve_pack`; ``self.pack_note`` says which and why)."""
        note = explain_dtype(dtype, device)
        dtype = resolve_dtype(dtype, device)
        t, d, tok, tmap = load_models(target, draft, dtype=dtype, seed=seed)
        return cls(t, d, tok, device=device, dtype=dtype, token_map=tmap, fuse=fuse, dtype_note=note, pack=pack)

    # ------------------------------------------------------------------ prompts
    def encode(self, prompts: Sequence[Union[str, Sequence[int]]], chat: bool = True) -> List[List[int]]:
        """Token ids of each prompt (text through the chat template unless ``chat=False``); raises
        ``ValueError`` naming the first bad prompt (:meth:`ModelCalls.encode`)."""
        return self.calls.encode(prompts, chat)

    # ------------------------------------------------------------------ public API
    @torch.inference_mode()
    def generate(self, prompts, *, max_new_tokens: int, policy=None, temperature: float = 0.0, top_k: int = -1,
                 top_p: float = 1.0, seed: Optional[int] = None, chat: bool = True,
                 progress=None, token_cap: Optional[Union[int, str]] = None,
                 calibrate: bool = False, draft_prune: float = 0.5) -> List[GenerationResult]:
        """Generate for a batch of prompts; ``policy`` is one dict, a list (one per prompt), or None.

        ``prompts``: a list of texts / token-id lists (a single text is one prompt). A request whose
        prompt or policy dict is invalid gets ``error`` set and no tokens; the rest run.
        ``progress`` is an optional callable ``(n_new_tokens) -> None`` called after each round.
        ``token_cap``: the batch's token cap T, the tokens the batch verifies per round (roots included),
        scaled down in proportion as requests finish (ceil(T * running / batch)). Each request's policy still
        proposes its own tree; :func:`~treespec_sglang.policies.token_cap.allocate_batch` keeps the nodes with
        the highest path probabilities across the batch (ancestor-closed, every root kept; one host read
        per round sizes the verify to the largest kept tree). None: every request verifies its whole tree.
        ``token_cap="auto"``: T is chosen every round by
        :func:`~treespec_sglang.policies.token_cap.best_total`: the most expected tokens per millisecond
        under a round-cost line learned from this call's own rounds, its prior slope from this machine's
        start-up verify curve (:class:`~treespec_sglang.engine.round_cost.RoundCost`, :meth:`_round_cost`).
        A request whose policy dict carries ``"token_cap": False`` keeps its whole tree (its nodes
        still count against T); the others share what is left.
        ``calibrate`` (with ``token_cap``): weigh the path probabilities by a per-depth acceptance
        correction learned online during the call (:class:`~treespec_sglang.policies.calibration.
        DepthCalibration`; left in ``self.calibration`` for its curve).
        ``draft_prune`` (with ``"auto"``): a sharing request's draft expands only the frontier nodes whose path
        probability is at least ``draft_prune`` x the round's marginal value (the last round's tokens per ms
        x the line's ms per verified token: a node below it is not worth verifying, nor is anything under
        it), and the draft runs on those nodes only; 0 drafts every policy's whole tree.
        """
        o = GenerateOptions(max_new_tokens, temperature, top_k, top_p, seed, chat, token_cap, calibrate,
                            draft_prune)  # validated before any compute
        a = admit(self, prompts, policy, o)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(o.seed if o.seed is not None else int(torch.randint(0, 2 ** 62, ()).item()))
        if not a.ok:
            return a.results
        plain = a.plain
        max_nodes = 1 if plain else max(p.max_nodes for p in a.params)
        check_fits(estimate_generate_bytes(
            self.target.config, None if plain else self.draft.config, bs=len(a.ok),
            max_prompt=max(len(x) for x in a.ids), max_new=o.max_new_tokens, max_nodes=max_nodes,
            dtype=self.dtype, draft_vocab=self.draft_vocab), self.device, bs=len(a.ok), max_nodes=max_nodes)
        t0 = time.perf_counter()
        run = self._plain if plain else self._speculative
        self.calibration = DepthCalibration() if o.calibrate and not plain else None
        if o.token_cap == "auto" and not plain:
            token_cap = "auto"
            self.measured_cost_curve()  # measured (or cached) before the timed loop starts
        else:
            token_cap = None if o.token_cap is None else int(o.token_cap)
        extra = {} if plain else {"token_cap": token_cap, "calibration": self.calibration, "shares": a.shares,
                                  "prune": o.draft_prune if token_cap == "auto" else 0.0}
        outs = run(a.ids, a.params, [a.results[i].stats for i in a.ok], o.max_new_tokens, o.sampling, gen, progress,
                   **extra)
        dt = time.perf_counter() - t0
        for i, toks in zip(a.ok, outs):
            a.results[i].token_ids = toks
            a.results[i].stats.time_s = dt
            if self.tokenizer is not None:
                a.results[i].text = self.tokenizer.decode(toks, skip_special_tokens=True)
        return a.results

    # ------------------------------------------------------------------ shared pieces
    @staticmethod
    def _finish(outs, new_tokens, eos, max_new):
        """Append each row's new tokens up to EOS / the length limit -> (done flags, tokens appended)."""
        done, added = [], 0
        for out, new in zip(outs, new_tokens):
            before = len(out)
            for t in new:
                out.append(t)
                if t in eos or len(out) >= max_new:
                    break
            added += len(out) - before
            done.append(bool(out) and (out[-1] in eos or len(out) >= max_new))
        return done, added

    def _advance(self, outs, running, new_tokens, max_new, progress) -> List[int]:
        """Commit a round's tokens of the ``running`` requests (their indices in the call); return the positions
        (within ``running``) of the requests that continue (empty when every request has finished)."""
        done, added = self._finish([outs[r] for r in running], new_tokens, self.eos, max_new)
        if progress:
            progress(added)
        return [i for i, d in enumerate(done) if not d]

    # ------------------------------------------------------------------ plain decoding
    def _plain(self, ids, params, stats, max_new, sampling, gen, progress):
        bs = len(ids)
        max_len = max(len(x) for x in ids) + max_new + 1
        cache, _, _, lens, logits = self.calls.prefill(ids, max_len)
        lens_h = [len(x) for x in ids]  # host copy of lens: no sync to size the attention
        outs: List[List[int]] = [[] for _ in range(bs)]
        running = list(range(bs))  # original index of each active row
        tok = sample(logits, generator=gen, **sampling)
        for s in stats:
            s.rounds += 1
        while True:
            keep = self._advance(outs, running, [[t] for t in tok.tolist()], max_new, progress)
            if not keep:
                return outs
            if len(keep) < len(running):
                k = torch.tensor(keep, device=self.device)
                cache.select(k)
                tok, lens = tok[k], lens[k]
                running = [running[i] for i in keep]
                lens_h = [lens_h[i] for i in keep]
            pos = lens[:, None]
            kv = max(lens_h) + 1
            mask = torch.arange(kv, device=self.device)[None, None, :] <= lens[:, None, None]
            h = self.target(tok[:, None], pos, cache.stores(pos, kv), mask)
            lens = lens + 1
            lens_h = [x + 1 for x in lens_h]
            tok = sample(self.calls.logits(h[:, 0]), generator=gen, **sampling)
            for r in running:
                stats[r].rounds += 1

    # ------------------------------------------------------------------ speculative decoding
    def _speculative(self, ids, params, stats, max_new, sampling, gen, progress, *, token_cap, calibration, shares,
                     prune: float):
        bs, dev = len(ids), self.device
        max_nodes = max(p.max_nodes for p in params)
        caps = TokenCapPlan(token_cap, bs, max_nodes, self._round_cost() if token_cap == "auto" else None, prune)
        max_len = max(len(x) for x in ids) + max_new + max_nodes + 2
        cache, inp, hidden, lens, logits = self.calls.prefill(ids, max_len)
        dcfg = self.draft.config
        dcache = KVCache(1, bs, dcfg.num_key_value_heads, max_len + 1, dcfg.head_dim, self.dtype, dev)
        root = sample(logits, generator=gen, **sampling)  # [bs]
        # draft prefill: pairs (h_{p-1}, x_p) for p = 1..P_b, with x_{P_b} = root
        toks = torch.cat([inp[:, 1:], torch.zeros_like(inp[:, :1])], dim=1)
        toks.scatter_(1, (lens - 1)[:, None], root[:, None])
        f_root, root_lp = self.calls.draft_extend(dcache, toks, hidden, torch.ones_like(lens), lens, kv=inp.shape[1] + 1)
        b = Batch(cache, dcache, root, lens, f_root, root_lp, [len(x) for x in ids])
        outs: List[List[int]] = [[] for _ in range(bs)]
        running = list(range(bs))
        for s in stats:
            s.rounds += 1
        pending = [[t] for t in root.tolist()]  # the first token comes from the prefill
        while True:
            keep = self._advance(outs, running, pending, max_new, progress)
            if not keep:
                return outs
            if len(keep) < len(running):
                b.select(keep, dev)
                running = [running[i] for i in keep]
            t0 = time.perf_counter()
            drafted = stats[running[0]].draft_forwards  # every running request counts the round's draft forwards
            opts = RoundOptions(sampling, gen, caps.cap(len(running)), calibration, [shares[r] for r in running],
                                self.observer)
            pending = self._round(b, [params[r] for r in running], [stats[r] for r in running], opts)
            caps.observe(sum(stats[r].tree_sizes[-1] for r in running), 1e3 * (time.perf_counter() - t0), len(running),
                         sum(len(p) for p in pending), stats[running[0]].draft_forwards - drafted)

    def _round(self, b: Batch, params, stats, opts: RoundOptions) -> List[List[int]]:
        """One draft -> plan -> verify -> commit -> record round (:mod:`.round`); moves ``b`` to the next
        round and returns each request's committed tokens. The only syncs are grow_tree's per-step check
        and record's one transfer."""
        tree, expand, recorder = draft(self.calls, b, params, opts)
        tree, rows = plan(self.calls, tree, opts)
        hidden, result = verify(self.calls, b, tree, rows, opts)
        if opts.calibration is not None:
            opts.calibration.update(tree, result.path)
        if recorder is not None:
            opts.observer(tree, recorder.parent_entropy(tree), result)
        em = commit(self.calls, b, tree, result, hidden)
        return record(b, stats, em, result, tree, expand)

    def measured_cost_curve(self, bs: int = 1):
        """This machine's cost curve for this engine at batch ``bs`` -> (CostCurve, whether it came from the
        disk cache).

        Measured once per engine and batch size (:func:`~treespec_sglang.engine.cost.measure_cost_curve`,
        cached on disk per CPU / torch / dtype / threads / model shape / batch). The bs-1 curve is kept in
        ``self.cost_curve``; assign ``engine.cost_curve`` to use another curve."""
        from ..models.demo import cache_dir
        from .cost import measure_cost_curve

        if bs != 1:
            if bs not in self._batch_curves:
                self._batch_curves[bs] = measure_cost_curve(self, cache_dir=cache_dir(),
                                                            model_id=str(self.target.config), bs=bs)
            return self._batch_curves[bs]
        if self.cost_curve is None:
            self.cost_curve, self._cost_from_disk = measure_cost_curve(self, cache_dir=cache_dir(),
                                                                       model_id=str(self.target.config))
        return self.cost_curve, self._cost_from_disk

    def _round_cost(self):
        """A fresh round-cost line for one ``token_cap="auto"`` call, its prior from this machine's
        start-up verify curve (:meth:`~treespec_sglang.engine.round_cost.RoundCost.from_curve`)."""
        from .round_cost import RoundCost

        return RoundCost.from_curve(self.measured_cost_curve()[0])

