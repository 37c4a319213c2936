"""The hooks the plugin registers with SGLang 0.5.23's ``HookRegistry`` (the only sglang importer).

| target | type | what it does |
|---|---|---|
| ``ServerArgs.add_cli_args`` | AFTER | adds ``--treespec-policy`` / ``-config`` / ``-token-cap`` / ``-classifier`` |
| ``ServerArgs.from_cli_args`` | AFTER | validates them (a default the server cannot draft stops it), exports the env |
| ``SamplingParams.verify`` | AFTER | validates ``custom_params["treespec"]``: a bad value fails that request only |
| ``TokenizerManager._handle_batch_request`` | BEFORE | marks malformed batch items instead of failing the whole call |
| ``Scheduler._create_generation_req`` | AFTER | a marked item, or a policy this server cannot draft (a tree on a
  chain server, any on the multi-layer EAGLE worker), finishes at once as an abort carrying its message |
| ``EagleDraftWorker.draft`` | AROUND | stages each request's policy for this draft step; native when none |
| ``eagle_worker_common.prepare_for_draft`` | AFTER | remembers the draft graph runner; C2T chain stops draft eagerly |
| ``eagle_utils.organize_draft_results`` | AROUND | SGLang's own selection (kept inside its draft graph); the pool
  is copied into per-shape buffers (:mod:`.draft_select`) |
| ``eagle_worker_common.build_eagle_verify_input`` | AROUND | per-request trees on the pool after the draft (eager or
  replay), the batch's token cap (``--treespec-token-cap``), rank 0's tree; unlinks the filler nodes |
| ``SchedulerOutputStreamer.is_request_level_customized_info_key`` | AROUND | ``treespec_*`` stats are per request |
| ``_GenerationStreamAccumulator.accept`` | AROUND | a stream's chunks carry the rounds since the last chunk (.stats) |
| ``ModelRunner.forward`` | AROUND | chain draft loop: feeds each step's logits to the C2T stop; target verify on the
  CPU: runs only the real tree nodes (ragged verify, :mod:`.ragged`) |
| ``IntelAMXAttnBackend._build_extend_metadata`` | AROUND | per-request extend lengths / tree masks of a ragged verify |
| ``IntelAMXAttnBackend.init_forward_metadata`` | AFTER | a uniform ragged verify's extend length (the plan's width) |
| ``EagleVerifyInput.generate_attn_arg_prefill`` | AROUND | FlashInfer ragged verify: the padded paged args compacted |
| ``{Decode,Prefill}CudaGraphRunner.can_run_graph`` | AROUND | a ragged verify runs eagerly |
| ``EAGLEWorkerV2.forward_batch_generation`` | AROUND | the round's requests, for the per-round verify-token stats |
| ``SchedulerBatchResultProcessor._resolve_spec_v2_tokens`` | AFTER | records each round's accepted drafts |
| ``eagle_utils.verify_tree_greedy_func`` | AROUND | several ranks: rank 0's greedy verify outcome on every rank |
| ``eagle_utils._verify_uses_greedy`` | AROUND | on CPU, T > 0 takes the exact sampling verify (:mod:`.cpu.sampling`) |
| ``Scheduler.init_metrics_collector`` | AFTER | the plugin's Prometheus series beside SGLang's (:mod:`.metrics`) |
| ``TokenizerManager.init_metric_collector_watchdog`` | AFTER | the refused-requests counter |
| ``utils.common.build_server_info`` | AFTER | ``/server_info`` gains a ``treespec`` section (:mod:`.info`) |
| ``parallel_state.init_model_parallel_group`` | AROUND | CPU (gloo) groups get no PyNccl (TP on the CPU) |
| ``EagleDraftWorker.init_lm_head`` | AROUND | the draft's class fits the algorithm (EAGLE-3 head <-> EAGLE3); ranks'
  settings must agree; a token map under TP keeps each rank's shard of the hot head rows (:mod:`.ranks`) |
| ``dp_attn._spec_input_cuda_graph_compatible`` | AFTER | DP attention in chain mode: a treespec batch votes for an
  eager draft before the ranks' votes are reduced |

Per-request stats go to ``req.customized_info`` (-> the response's ``meta_info``):
``treespec_policy``, ``treespec_summary`` (totals over every round, :mod:`.stats`),
``treespec_tree_sizes`` (verified nodes per round, root included),
``treespec_verify_tokens`` (tokens the target's verify forward processed for the request per round:
its tree size with ragged verify, the batch's widest tree in a CPU tree verify, N when padded) and ``treespec_accept_lengths`` (accepted draft
tokens per round, bonus excluded: tau = 1 + mean). The accept lengths are read where the scheduler
already has them on the host (no extra sync); the tree sizes are copied to the host asynchronously and
recorded once that copy is done (:class:`PendingSizes`).

Ragged verify (:mod:`.ragged`, ``TREESPEC_RAGGED_VERIFY``) is on by default for the CPU ``intel_amx``
backend, opt-in (``=1``) for SGLang's FlashInfer backend (not yet run on a GPU), off with ``=0``.
Elsewhere every request verifies N tokens with its filler nodes unlinked.

Several ranks (:mod:`.ranks`): every rank of the attention TP group takes rank 0's tree each round and
rank 0's greedy verify outcome (one int64 broadcast each), so what they draft and accept agrees by
construction.

With no server default and no request carrying ``custom_params["treespec"]`` every hook calls
straight through, so SGLang behaves exactly as without the plugin.
"""

from __future__ import annotations

import contextvars
import json
import logging
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..policies.params import NoneParams
from ..utils.deprecation import UNSET, renamed_arg
from .chain_stop import ChainStopper
from .classifiers import parse_classifier_flags
from .config import ServerDefaults, configure, draft_algorithm_mismatch, server_defaults
from .info import server_info
from .metrics import count_refused, enable_scheduler, enable_tokenizer
from .draft_select import capturing, select_after_draft, stash_pool
from .graph_log import register_counting
from .pool import unlink_filler
from .ranks import agree_verify, check_settings_agree, cpu_parallel_group, shard_hot_head, \
    verify_group
from .ragged import amx_extend_metadata, amx_forward_metadata, eager_while_ragged, flashinfer_verify_args, \
    ragged_verify_forward
from .request import ERROR_KEY, flag_invalid_items, request_params, request_shares, unsupported_reason, \
    validate_custom_params
from .stats import PendingSizes, policy_name, record_round, stream_accept

logger = logging.getLogger("treespec_sglang.plugin")

__all__ = ["HOOKS", "SIGNATURES", "register_hooks", "DraftStep"]

# The request policies of the draft step in progress (set by the draft() hook, read by the others).
_STEP: contextvars.ContextVar = contextvars.ContextVar("treespec_draft_step", default=None)
# The requests of the speculative round in progress (draft + verify), for per-round stats.
_ROUND: contextvars.ContextVar = contextvars.ContextVar("treespec_round_reqs", default=None)
_BUILD = "sglang.srt.speculative.eagle_worker_common.build_eagle_verify_input"
KEEP_ATTR = "treespec_keep"  # on SGLang's verify input: [bs, N] bool kept nodes
DRAFTED = "_treespec_drafted"  # on a Req: drafted with its policy at least once (its stats are ours to keep)


class DraftStep:
    """Per-step state shared by the draft-loop hooks: one policy (or None = native) per row."""

    def __init__(self, params: List, topk: int, shares: Optional[List[bool]] = None,
                 token_cap: Optional[int] = None):
        self.params = params
        self.topk = topk
        self.shares = shares if shares is not None else [False] * len(params)  # rows under the token cap
        self.token_cap = token_cap  # mean verified tokens per sharing request (None: off)
        self.keep: Optional[torch.Tensor] = None  # [bs, N] bool after selection
        self.chain: Optional[ChainStopper] = None  # chain mode (topk = 1) with C2T early stop
        self.runner = None  # SGLang's draft graph runner when this round's draft is a replay

    @property
    def sizes(self) -> Optional[torch.Tensor]:
        """``[bs]`` int64 verified tree sizes (root included), once the selection is made."""
        return None if self.keep is None else self.keep.long().sum(-1)


# ---------------------------------------------------------------------------- server flags
def _add_cli_args(result, parser, *args, **kwargs):
    g = parser.add_argument_group("treespec", "per-request draft-tree policies (treespec-sglang plugin)")
    g.add_argument("--treespec-policy", type=str, default=None,
                   help="default tree policy for requests without custom_params['treespec'] "
                        "(eagle2, talon, salf, c2t, chain); unset = SGLang's own tree")
    g.add_argument("--treespec-config", type=str, default=None,
                   help='JSON object of the default policy\'s parameters, e.g. \'{"budget": 60, "mu": 0.03}\'')
    g.add_argument("--treespec-token-cap", type=int, default=None,
                   help="the batch's token cap: the treespec requests of a round verify this many tokens "
                        "each on average (roots included), spent where the draft's path probabilities are highest; "
                        'a request opts out with {"token_cap": false} in custom_params["treespec"]')
    g.add_argument("--treespec-batch-budget", type=int, default=None,
                   help="deprecated name of --treespec-token-cap")
    g.add_argument("--treespec-classifier", action="append", default=None, metavar="NAME=PATH",
                   help="register a C2T classifier file under NAME (repeatable); requests pick one with "
                        '{"classifier": "NAME"} and never name a file; "default" (the shipped one) is always there')
    return result


def _from_cli_args(result, cls, args, *a, **k):
    policy = getattr(args, "treespec_policy", None)
    raw = getattr(args, "treespec_config", None)
    old = getattr(args, "treespec_batch_budget", None)
    token_cap = renamed_arg(getattr(args, "treespec_token_cap", None), UNSET if old is None else old,
                            "--treespec-batch-budget", "--treespec-token-cap", stacklevel=3)
    classifiers = parse_classifier_flags(getattr(args, "treespec_classifier", None))
    if policy is None and raw is None and token_cap is None and not classifiers:
        return result
    try:
        config = json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--treespec-config must be a JSON object: {e}") from None
    defaults = configure(policy, config, token_cap, classifiers or None)  # validates (ValueError naming field and
    # range), exports to the env; a default this server cannot draft stops it here, not every request later
    reason = unsupported_reason(request_params(None, defaults), result)
    if reason is not None:
        raise ValueError(f"--treespec-policy {reason}")
    thresholds = [getattr(args, n, 1.0) for n in ("speculative_accept_threshold_single",
                                                    "speculative_accept_threshold_acc")]
    if any(t is not None and t != 1.0 for t in thresholds):
        logger.warning("treespec: --speculative-accept-threshold-single/acc != 1 relaxes verification; "
                       "sampling is then not lossless (greedy is unaffected)")
    return result


# ---------------------------------------------------------------------------- request validation
def _verify_sampling_params(result, self, *args, **kwargs):
    try:
        validate_custom_params(getattr(self, "custom_params", None))
    except ValueError as e:
        count_refused(str(e))
        raise
    return result


def _handle_batch_request(self, obj, *args, **kwargs):
    if not hasattr(obj, "sampling_params"):  # embedding requests carry none
        return
    obj.sampling_params = flag_invalid_items(obj.sampling_params)
    if isinstance(obj.sampling_params, list):
        for sp in obj.sampling_params:
            cp = sp.get("custom_params") if isinstance(sp, dict) else None
            if isinstance(cp, dict) and ERROR_KEY in cp:
                count_refused(str(cp[ERROR_KEY]))
    # GenerateReqInput caches the per-item objects obj[i] it already handed out: point them at the copies
    for i, sub in (obj.__dict__.get("_sub_obj_cache") or {}).items():
        if isinstance(obj.sampling_params, list) and hasattr(sub, "sampling_params"):
            sub.sampling_params = obj.sampling_params[i]


def _create_generation_req(req, self, *args, **kwargs):
    cp = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    msg = str(cp[ERROR_KEY]) if isinstance(cp, dict) and ERROR_KEY in cp else None
    if msg is None:
        try:  # parsed here, once: every rank sees the same request and (checked at start) the same settings
            msg = unsupported_reason(_req_params(req, server_defaults()), getattr(self, "server_args", None))
        except ValueError as e:  # a value that skipped the tokenizer's validation: refused, never a fallback
            msg = str(e)
    if msg is not None:
        # finish this request alone, before any compute; no status code, so the batch's gather
        # returns it as an output (finish_reason abort + message) instead of raising for everyone
        req.set_finish_with_abort(msg, status_code=None, err_type="BadRequestError")
    return req


# ---------------------------------------------------------------------------- draft loop
_UNSET = object()


def _req_params(req, defaults: ServerDefaults):
    """A request's policy, parsed once and cached on the request object."""
    p = getattr(req, "_treespec_params", _UNSET)
    if p is _UNSET:
        p = request_params(req.sampling_params, defaults)
        try:
            req._treespec_params = p
        except AttributeError:  # a slotted request type: recompute next time
            pass
    return p


_PENDING = PendingSizes()


def _draft(original, self, batch, *args, **kwargs):
    _PENDING.flush()
    defaults = server_defaults()
    reqs = getattr(batch, "reqs", None) or []
    params = [_req_params(r, defaults) for r in reqs]
    if not any(p is not None for p in params):
        return original(self, batch, *args, **kwargs)  # native SGLang
    # a request with speculation off ({"policy": "none"}) verifies its root alone and shares nothing
    shares = [p is not None and not isinstance(p, NoneParams) and request_shares(r.sampling_params)
              for r, p in zip(reqs, params)]
    step = DraftStep(params, self.topk, shares, defaults.token_cap)
    if self.topk == 1:  # chain mode: only the C2T early stop applies (other policies need a tree)
        stopper = ChainStopper(params, self.speculative_num_steps, getattr(self, "device", "cpu"))
        step.chain = stopper if stopper.active else None
        if step.chain is None:
            return original(self, batch, *args, **kwargs)
    token = _STEP.set(step)
    try:
        out = original(self, batch, *args, **kwargs)
    finally:
        _STEP.reset(token)
    if step.sizes is not None:
        for req, p in zip(reqs, params):
            if p is not None:
                setattr(req, DRAFTED, True)
        _PENDING.push(list(reqs), params, step.sizes)  # a copy: SGLang edits batch.reqs in place
    return out


def _request_level_key(original, self, key, *args, **kwargs):
    return str(key).startswith("treespec_") or original(self, key, *args, **kwargs)


def _prepare_for_draft(result, *args, **kwargs):
    # Tree mode keeps SGLang's draft CUDA graph: the selection runs after the draft on the pool the graph
    # wrote (draft_select). Chain mode's C2T stop reads every step's logits, which a replay cannot show.
    step = _STEP.get()
    if step is None:
        return result
    forward_batch, can_run_graph, kv_loc_plan = result
    if step.chain is not None:
        return forward_batch, False, kv_loc_plan
    step.runner = (kwargs.get("cuda_graph_runner", args[3] if len(args) > 3 else None)) if can_run_graph else None
    return result


def _organize(original, score_list, token_list, parents_list, num_draft_token, *args, **kwargs):
    # SGLang's own selection stays (inside its graph when captured); the pool is copied aside for ours
    out = original(score_list, token_list, parents_list, num_draft_token, *args, **kwargs)
    if _STEP.get() is not None or capturing(score_list[0]):
        stash_pool(score_list, token_list, parents_list)
    return out


def _build_verify_input(original, *args, **kwargs):
    step = _STEP.get()
    if step is not None and step.chain is None:  # the policy trees replace SGLang's selection
        a = dict(zip(SIGNATURES[_BUILD], args), **kwargs)
        rows = step.runner.bs if step.runner is not None else None  # a replay's padded batch
        a["top_scores_index"], a["draft_tokens"] = select_after_draft(
            step, rows, a["top_scores_index"], a["draft_tokens"], a["num_draft_tokens"], a["num_steps"])
        result = original(**a)
    else:
        result = original(*args, **kwargs)
    return _verify_input(result)


def _record_verify_tokens(per_request) -> None:
    reqs = _ROUND.get()
    if reqs is None:
        return
    for req, n in zip(reqs, per_request):
        p = getattr(req, "_treespec_params", None)
        if p is not None and getattr(req, DRAFTED, False):
            record_round(req, policy_name(p), "treespec_verify_tokens", n)


def _eagle_round(original, self, batch, *args, **kwargs):
    token = _ROUND.set(getattr(batch, "reqs", None))
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        _ROUND.reset(token)


def _runner_forward(original, self, forward_batch, *args, **kwargs):
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is not None and mode.is_target_verify():
        keep = getattr(forward_batch.spec_info, KEEP_ATTR, None)
        if keep is not None:
            return ragged_verify_forward(original, self, forward_batch, keep, _record_verify_tokens, *args, **kwargs)
    out = original(self, forward_batch, *args, **kwargs)
    step = _STEP.get()
    if step is not None and step.chain is not None:  # inside a chain draft loop: score this step
        logits = getattr(getattr(out, "logits_output", None), "next_token_logits", None)
        if logits is not None:
            step.chain.observe(logits)
    return out


_DRAFT_TOPK: Dict[str, int] = {}  # the draft worker's topk in this process (chain mode: 1)


def _draft_head(original, self, *args, **kwargs):
    # the draft's class must fit the algorithm (an EAGLE-3 head under EAGLE runs and accepts nothing)
    runner = getattr(self, "draft_runner", None)
    algo = getattr(self, "speculative_algorithm", None)
    if runner is not None and algo is not None:
        reason = draft_algorithm_mismatch(type(runner.model).__name__, bool(algo.is_eagle3()))
        if reason is not None:
            raise ValueError(f"treespec: {reason}")
    # the spec worker is built on every rank after the groups: settings must agree before any round
    check_settings_agree(verify_group())
    if getattr(self, "topk", None) is not None:
        _DRAFT_TOPK["topk"] = int(self.topk)
    return shard_hot_head(original, self, *args, **kwargs)


def _draft_graph_vote(result, local_batch, *args, **kwargs):
    # DP attention: each rank votes on the draft CUDA graph before SGLang min-reduces the votes across
    # ranks. Tree mode keeps the graph (the selection runs after it); in chain mode a batch carrying
    # treespec policies votes no, so every rank agrees to draft eagerly for the C2T stop (after the vote,
    # turning the graph off on one rank would desynchronise the collectives)
    if not result or local_batch is None or not getattr(local_batch, "reqs", None) \
            or not local_batch.forward_mode.is_decode() or _DRAFT_TOPK.get("topk", 1) > 1:
        return result
    defaults = server_defaults()
    return not any(_req_params(r, defaults) is not None for r in local_batch.reqs)


def _verify_input(result, *args, **kwargs):
    step = _STEP.get()
    if step is not None and step.chain is not None:
        step.keep = step.chain.keep_mask(result.retrieve_next_token.shape[-1], verify_group())
    if step is None or step.keep is None:
        return result
    nt, ns = unlink_filler(result.retrieve_next_token, result.retrieve_next_sibling, step.keep)
    result.retrieve_next_token.copy_(nt)
    result.retrieve_next_sibling.copy_(ns)
    setattr(result, KEEP_ATTR, step.keep)  # the verify forward may then run the kept nodes only
    return result


def _record_accepts(result, self, batch_result, batch, *args, **kwargs):
    _PENDING.flush()  # the tree sizes of the rounds resolved so far come first
    per = getattr(batch_result, "num_correct_drafts_per_req_cpu", None)  # host list, set by the hooked body
    if per is None:
        return result
    for req, n in zip(batch.reqs, per):
        p = getattr(req, "_treespec_params", None)
        if p is None or not getattr(req, DRAFTED, False):
            continue  # native request (or one never drafted with a policy)
        if req.is_retracted or req.finished():
            continue  # SGLang commits nothing for these either
        record_round(req, policy_name(p), "treespec_accept_lengths", n)
    return result


def _scheduler_metrics(result, self, *args, **kwargs):
    # SGLang made its scheduler collector (stats-logging ranks with --enable-metrics): ours beside it
    collector = getattr(self, "metrics_collector", None)
    if collector is not None:
        enable_scheduler(getattr(collector, "labels", {}))
    return result


def _tokenizer_metrics(result, self, *args, **kwargs):
    if getattr(self, "enable_metrics", False):
        enable_tokenizer(getattr(getattr(self, "metrics_collector", None), "labels", {}) or {})
    return result


def _server_info(result, *args, **kwargs):
    if isinstance(result, dict):
        result["treespec"] = server_info()
    return result


_CPU_SAMPLING = ("tree_speculative_sampling_target_only", "top_k_renorm_prob", "top_p_renorm_prob")


def _verify_uses_greedy(original, *args, **kwargs):
    # SGLang verifies greedily on CPU at any temperature (its sampling ops are None there). Give the
    # CPU the exact sampling walk instead, so speculative output at T > 0 follows the target.
    if not kwargs.get("is_cpu"):
        return original(*args, **kwargs)
    import sys

    from .cpu import sampling

    eagle_utils = sys.modules["sglang.srt.speculative.eagle_utils"]
    for name in _CPU_SAMPLING:
        if getattr(eagle_utils, name, None) is None:
            setattr(eagle_utils, name, getattr(sampling, name))
    return original(*args, **{**kwargs, "is_cpu": False})


# target -> (hook type, hook body, the parameters the body assumes of its target: checked against the
# installed sglang in tests)
HOOKS: Dict[str, Tuple[str, Callable, List[str]]] = {
    "sglang.srt.server_args.ServerArgs.add_cli_args":
        ("AFTER", _add_cli_args, ["parser"]),
    "sglang.srt.server_args.ServerArgs.from_cli_args":
        ("AFTER", _from_cli_args, ["cls", "args"]),
    "sglang.srt.sampling.sampling_params.SamplingParams.verify":
        ("AFTER", _verify_sampling_params, ["self", "vocab_size"]),
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_request":
        ("BEFORE", _handle_batch_request, ["self", "obj", "request", "request_states"]),
    "sglang.srt.managers.scheduler.Scheduler._create_generation_req":
        ("AFTER", _create_generation_req, ["self", "recv_req", "args", "kwargs"]),
    "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.draft":
        ("AROUND", _draft, ["self", "batch", "with_topology"]),
    "sglang.srt.speculative.eagle_worker_common.prepare_for_draft":
        ("AFTER", _prepare_for_draft, ["draft_input", "req_to_token_pool", "batch", "cuda_graph_runner",
         "draft_model_runner", "topk", "num_steps", "target_translator", "num_draft_tokens"]),
    "sglang.srt.speculative.eagle_utils.organize_draft_results":
        ("AROUND", _organize, ["score_list", "token_list", "parents_list", "num_draft_token"]),
    "sglang.srt.speculative.eagle_worker_common.build_eagle_verify_input":
        ("AROUND", _build_verify_input, ["batch", "draft_input", "parent_list", "top_scores_index", "draft_tokens",
         "draft_probs", "target_worker", "topk", "num_steps", "num_draft_tokens", "tree_mask_mode", "device"]),
    "sglang.srt.model_executor.model_runner.ModelRunner.forward":
        ("AROUND", _runner_forward, ["self", "forward_batch", "skip_attn_backend_init", "pp_proxy_tensors",
         "reinit_attn_backend", "split_forward_count"]),
    "sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend._build_extend_metadata":
        ("AROUND", amx_extend_metadata, ["self", "forward_batch"]),
    "sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend.init_forward_metadata":
        ("AFTER", amx_forward_metadata, ["self", "forward_batch"]),
    "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation":
        ("AROUND", _eagle_round, ["self", "batch", "on_publish", "grammar_barrier", "pp_proxy_tensors"]),
    "sglang.srt.speculative.eagle_info.EagleVerifyInput.generate_attn_arg_prefill":
        ("AROUND", flashinfer_verify_args, ["self", "req_pool_indices", "paged_kernel_lens", "paged_kernel_lens_sum",
         "translator", "plan", "kind"]),
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph":
        ("AROUND", eager_while_ragged, ["self", "forward_batch"]),
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph":
        ("AROUND", eager_while_ragged, ["self", "forward_batch"]),
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
    ".is_request_level_customized_info_key":
        ("AROUND", _request_level_key, ["self", "key"]),
    "sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator.accept":
        ("AROUND", stream_accept, ["self", "req"]),
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
    "._resolve_spec_v2_tokens":
        ("AFTER", _record_accepts, ["self", "result", "batch"]),
    "sglang.srt.speculative.eagle_utils.verify_tree_greedy_func":
        ("AROUND", agree_verify, ["predicts", "accept_index", "accept_token_num", "candidates", "retrieve_index",
         "retrieve_next_token", "retrieve_next_sibling", "target_predict", "topk"]),
    "sglang.srt.speculative.eagle_utils._verify_uses_greedy":
        ("AROUND", _verify_uses_greedy, ["is_all_greedy", "is_cpu", "is_hip", "is_xpu", "use_rejection_sampling"]),
    "sglang.srt.managers.scheduler.Scheduler.init_metrics_collector":
        ("AFTER", _scheduler_metrics, ["self"]),
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.init_metric_collector_watchdog":
        ("AFTER", _tokenizer_metrics, ["self"]),
    "sglang.srt.utils.common.build_server_info":
        ("AFTER", _server_info, ["server_args", "scheduler_info"]),
    "sglang.srt.distributed.parallel_state.init_model_parallel_group":
        ("AROUND", cpu_parallel_group, ["group_ranks", "local_rank", "backend", "use_pynccl", "use_custom_allreduce",
         "use_message_queue_broadcaster", "group_name", "use_mscclpp", "use_torch_symm_mem_allreduce",
         "recovered_rank", "rank_offset", "max_world_size"]),
    "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.init_lm_head":
        ("AROUND", _draft_head, ["self"]),
    "sglang.srt.managers.scheduler_components.dp_attn._spec_input_cuda_graph_compatible":
        ("AFTER", _draft_graph_vote, ["local_batch"]),
}
SIGNATURES: Dict[str, List[str]] = {target: params for target, (_, _, params) in HOOKS.items()}


def register_hooks() -> None:
    """Register every hook (called by the ``sglang.srt.plugins`` entry point in each process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, (kind, fn, _) in HOOKS.items():
        HookRegistry.register(target, fn, getattr(HookType, kind))
    counting = register_counting(HookRegistry, HookType.AFTER, _treespec_round)  # TREESPEC_GRAPH_LOG only
    logger.info("treespec-sglang: registered %d hooks%s", len(HOOKS), " and CUDA-graph counting" if counting else "")


def _treespec_round() -> bool:
    """Whether the round in progress carries a treespec request (its draft step, or its round's requests)."""
    if _STEP.get() is not None:
        return True
    return any(getattr(r, "_treespec_params", None) is not None for r in (_ROUND.get() or ()))
