"""The hooks the plugin registers with SGLang 0.5.23's ``HookRegistry`` (the only sglang importer), in the
order they run: at server start, when a request arrives, then in each speculative round, whose state is one
:class:`~.round.PluginRound` (:mod:`.round`).

{table}

Per-request stats go to ``req.customized_info`` (-> the response's ``meta_info``):
``treespec_policy``, ``treespec_summary`` (totals over every round, :mod:`.stats`),
``treespec_tree_sizes`` (verified nodes per round, root included),
``treespec_verify_tokens`` (tokens the target's verify forward processed for the request per round:
its tree size with ragged verify, the batch's widest tree in a CPU tree verify, N when padded) and ``treespec_accept_lengths`` (accepted draft
tokens per round, bonus excluded: tau = 1 + mean). The accept lengths are read where the scheduler
already has them on the host (no extra sync); the tree sizes are copied to the host asynchronously and
recorded once that copy is done (:class:`PendingSizes`).

Ragged verify (:mod:`.ragged`, ``TREESPEC_RAGGED_VERIFY``) is on by default for the CPU ``intel_amx``
backend, tuned (each batch size verified ragged or padded, whichever measured faster), opt-in (``=1``, ``=tuned``)
for SGLang's FlashInfer backend, off with ``=0``.
Elsewhere every request verifies N tokens with its filler nodes unlinked.

Several ranks (:mod:`.ranks`): every rank of the attention TP group takes rank 0's tree each round and
rank 0's greedy verify outcome (one int64 broadcast each), so what they draft and accept agrees by
construction.

With no server default and no request carrying ``custom_params["treespec"]`` every hook calls
straight through, so SGLang behaves as without the plugin; the one exception, on purpose, is the greedy verify
under TP (every rank takes rank 0's outcome, native rounds included: :func:`.ranks.agree_verify`).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Callable, Dict, List

from .chain_graph import capture_cuts, chain_keep
from .chain_stop import chain_graph_enabled, chain_loop, record_step, recording_loop
from .columns import _policies, batch_columns
from .config import server_defaults
from .draft_select import capture_selections, capturing, select_after_draft, stash_pool, unlink
from .graph_log import register_counting
from .profile import profile_from_env, profiled
from .ragged import amx_extend_metadata, amx_forward_metadata, eager_while_ragged, flashinfer_verify_args, \
    ragged_verify_forward, ran_ragged
from .ranks import agree_verify, cpu_parallel_group, verify_group
from .metrics import scheduler_series
from .round import DraftStep, current, drafting_step, opened
from .server_hooks import (_add_cli_args, _create_generation_req, _draft_graph_vote, _draft_head,
                           _from_cli_args, _handle_batch_request, _request_level_key,
                           _scheduler_metrics, _server_info, _tokenizer_metrics, _verify_sampling_params,
                           _verify_uses_greedy)
from .pending import PendingSizes
from .stats import record_rounds, stream_accept, uncommitted

logger = logging.getLogger("treespec_sglang.plugin")

__all__ = ["HOOKS", "SIGNATURES", "Hook", "register_hooks", "DraftStep"]

_BUILD = "sglang.srt.speculative.eagle_worker_common.build_eagle_verify_input"
_PENDING = PendingSizes()


def _capture_selections(result, self, *args, **kwargs):
    # server start: SGLang captured its draft graphs (their replays stash the pool); the selection's graph of each
    # of their shapes is captured now, not in the first round of each batch-size bucket
    n = capture_selections(int(self.topk), int(self.speculative_num_draft_tokens))
    if n:
        logger.info("treespec-sglang: captured the selection graph of %d draft graph shapes", n)
    if int(self.topk) == 1:
        n = capture_cuts(int(self.speculative_num_steps), int(self.speculative_num_draft_tokens))
        if n:
            logger.info("treespec-sglang: captured the chain cut graph of %d draft graph shapes", n)
    return result


# ---------------------------------------------------------------------------- a round, as it runs
def _eagle_round(original, self, batch, *args, **kwargs):
    # the round's state lives as long as this call: draft, verify, draft extend
    with opened(getattr(batch, "reqs", None)) as r:
        out = original(self, batch, *args, **kwargs)
    if r.ragged:  # SGLang decided a graph before the ragged verify ran eagerly: its decode log and gauge say so
        out.can_run_cuda_graph = False
    return out


def _draft(original, self, batch, *args, **kwargs):
    if current() is None:  # a draft outside forward_batch_generation: a round of its own (module docstring of .round)
        with opened(getattr(batch, "reqs", None)):
            return _draft(original, self, batch, *args, **kwargs)
    _PENDING.flush()
    reqs = getattr(batch, "reqs", None) or []
    cols = batch_columns(reqs, server_defaults())
    if not cols.any_policy:
        return original(self, batch, *args, **kwargs)  # native SGLang
    current().reqs = cols.reqs  # the same requests, as the tuple the batch's caches hold: later checks by identity
    params, chain = cols.params, None
    if self.topk == 1:  # chain mode: only the C2T early stop applies (other policies need a tree)
        chain = cols.chain_stopper(self.speculative_num_steps, getattr(self, "device", "cpu"))
        if not chain.active:  # no request cuts its chain: every chain is SGLang's whole one
            return _sglangs_round(original, self, batch, cols, cols.whole_trees(self.speculative_num_draft_tokens),
                                  *args, **kwargs)
    else:
        params, tokens = cols.selection(self.speculative_num_draft_tokens, self.speculative_num_steps)
        if params is None:  # every tree is SGLang's own
            return _sglangs_round(original, self, batch, cols, tokens, *args, **kwargs)
    step = DraftStep(params, self.topk, cols.shares, cols.defaults.token_cap, chain=chain)
    r = current()
    r.step, r.drafting = step, True
    try:
        out = original(self, batch, *args, **kwargs)
    finally:
        r.drafting = False
    sizes = step.sizes  # [bs]
    if sizes is not None:  # the batch's requests as drafted (a tuple: SGLang may rebind or edit batch.reqs)
        _PENDING.push(cols.reqs, cols.drafted(), sizes)
    return out


def _sglangs_round(original, self, batch, cols, tokens, *args, **kwargs):
    """SGLang's own draft for a batch with policies whose trees (or chains) are all SGLang's."""
    out = original(self, batch, *args, **kwargs)
    _record_sglangs_trees(cols, tokens)
    return out


def _record_sglangs_trees(cols, tokens) -> None:
    """A round of SGLang's own trees for a batch with policies: their stats recorded as any round's (``tokens``:
    each request's tree size and verify tokens), so a request's per-round lists stay aligned whichever kind of
    round it was in."""
    names = cols.drafted()
    _PENDING.push(cols.reqs, names, tokens)
    record_rounds(cols.reqs, names, "treespec_verify_tokens", tokens)
    series = scheduler_series()
    if series is not None:  # its verify runs every node of every tree: padded
        series.verify_forward(False)


def _trivial_round(result, self, batch, *args, **kwargs):
    # adaptive speculation at 0 steps: no draft, the root alone verified (a plain decode); its accept length (0)
    # is recorded as every round's, so its tree size and verify tokens (1) are too
    cols = batch_columns(getattr(batch, "reqs", None) or [], server_defaults())
    if cols.any_policy:
        _record_sglangs_trees(cols, cols.whole_trees(1))
    return result


def _prepare_for_draft(result, *args, **kwargs):
    # Tree mode keeps SGLang's draft CUDA graph: the selection runs after the draft on the pool the graph
    # wrote (draft_select). Chain mode's C2T stop reads each step's statistics from the stash the loop writes:
    # a replay writes them only if its graph was captured recording them (TREESPEC_CHAIN_STOP_GRAPH=1).
    step = drafting_step()
    if step is None:
        return result
    forward_batch, can_run_graph, kv_loc_plan = result
    step.runner = None  # set when the graph replays (_draft_replayed): SGLang's draft() may still draft eagerly
    if step.chain is not None and step.chain.reads_steps and not chain_graph_enabled():
        return forward_batch, False, kv_loc_plan
    return result


def _draft_replayed(result, self, *args, **kwargs):
    # SGLang's draft graph replayed (its runner's execute: self.bs is the padded batch the pool was written for).
    # Only here: prepare_for_draft's "can run" is not the last word (draft() turns the graph off for a DSA
    # target seeding its top-k, and drafts eagerly; the pool is then this batch's own)
    step = drafting_step()
    if step is not None:
        step.runner = self
    return result


def _draft_loop(original, self, forward_batch, *args, **kwargs):
    # chain mode: the loop records each step's statistics for the C2T stop (chain_stop), eagerly in a round
    # with a beta, or while SGLang captures the loop's graph when TREESPEC_CHAIN_STOP_GRAPH=1
    step = drafting_step()
    if getattr(self, "topk", None) == 1 and ((step is not None and step.chain is not None and step.chain.reads_steps)
                                             or (capturing() and chain_graph_enabled())):
        with chain_loop(int(self.speculative_num_steps)):
            return original(self, forward_batch, *args, **kwargs)
    return original(self, forward_batch, *args, **kwargs)


def _organize(original, score_list, token_list, parents_list, num_draft_token, *args, **kwargs):
    # SGLang's own selection stays (inside its graph when captured); the pool and that selection
    # (out: parent_list, top_scores_index, draft_tokens) are copied aside for ours
    out = original(score_list, token_list, parents_list, num_draft_token, *args, **kwargs)
    if drafting_step() is not None or capturing(score_list[0]):
        stash_pool(score_list, token_list, parents_list, out[1])
    return out


def _build_verify_input(original, *args, **kwargs):
    step = drafting_step()
    if step is not None and step.chain is None:  # the policy trees replace SGLang's selection
        a = dict(zip(SIGNATURES[_BUILD], args), **kwargs)
        rows = step.runner.bs if step.runner is not None else None  # a replay's padded batch
        a["top_scores_index"], a["draft_tokens"], a["parent_list"] = select_after_draft(
            step, rows, a["top_scores_index"], a["draft_tokens"], a["num_draft_tokens"], a["num_steps"],
            a["parent_list"])
        result = original(**a)
    else:
        result = original(*args, **kwargs)
    return _verify_input(result)


def _verify_input(result, *args, **kwargs):
    step = drafting_step()
    if step is not None and step.chain is not None:  # the loop's steps are in the stash: cut each row's chain
        # a cut read off the draft's steps is rank 0's on every rank; one from the rows' lengths alone is the
        # same everywhere already (the ranks' settings and requests agree): no broadcast
        group = verify_group() if step.chain.reads_steps else None
        rows = step.runner.bs if step.runner is not None else None  # a replay's padded batch
        step.selected(*chain_keep(step.chain, rows, result.retrieve_next_token.shape[-1], group))
    if step is None or step.keep is None:
        return result
    unlink(result.retrieve_next_token, result.retrieve_next_sibling, step.keep)
    return result  # the round keeps step.keep: the verify forward may run the kept nodes only


def _runner_forward(original, self, forward_batch, *args, **kwargs):
    r = current()
    mode = getattr(forward_batch, "forward_mode", None)
    if r is not None and r.keep is not None and mode is not None and mode.is_target_verify():
        out, verified = ragged_verify_forward(original, self, forward_batch, r.keep, *args, **kwargs)
        _record_verify_tokens(r.reqs, verified)
        r.ragged = ran_ragged(verified, r.keep.shape[1])  # any request ran fewer than N tokens
        series = scheduler_series()
        if series is not None:
            series.verify_forward(r.ragged)
        return out
    out = original(self, forward_batch, *args, **kwargs)
    loop = recording_loop()
    if loop is not None and loop.i < loop.steps - 1:  # a step of a chain draft loop that records its statistics
        logits = getattr(getattr(out, "logits_output", None), "next_token_logits", None)
        if logits is not None:
            record_step(logits, loop.i, loop.steps)
            loop.i += 1
    return out


def _record_verify_tokens(reqs, per_request) -> None:
    reqs, policies = _policies(reqs or ())
    record_rounds(reqs, policies, "treespec_verify_tokens", per_request)


_RETRACTED, _FINISH = operator.attrgetter("is_retracted"), operator.attrgetter("finished_reason")


def _record_accepts(result, self, batch_result, batch, *args, **kwargs):
    _PENDING.flush()  # the tree sizes of the rounds resolved so far come first
    per = getattr(batch_result, "num_correct_drafts_per_req_cpu", None)  # host list, set by the hooked body
    if per is None:
        return result
    reqs, policies = _policies(batch.reqs)
    if not any(policies):
        return result  # a native batch
    # retracted and finished requests commit nothing (SGLang commits nothing for them either). SGLang's
    # Req.finished() is `finished_reason is not None`: read in C, so a round where none stopped (nearly every
    # round) pays no per-request Python
    if any(map(_RETRACTED, reqs)) or list(map(_FINISH, reqs)).count(None) != len(reqs):
        policies = [None if name is None or req.is_retracted or req.finished() else name
                    for req, name in zip(reqs, policies)]
        for req in reqs:
            if req.is_retracted and not req.finished():  # it runs again after a new prefill: cut its round now
                uncommitted(req)
    record_rounds(reqs, policies, "treespec_accept_lengths", per)
    return result


def _treespec_round() -> bool:
    """Whether the round in progress carries a treespec request (the CUDA-graph counter's label)."""
    r = current()
    return r is not None and r.carries_treespec()


# ---------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Hook:
    """One registration: SGLang's ``target``, the hook ``kind`` (BEFORE / AFTER / AROUND), the ``body``, the
    parameters the body assumes of its target (checked against the installed sglang in tests) and what it does."""

    target: str
    kind: str
    body: Callable
    params: List[str]
    does: str


_SA, _SCHED, _SPEC = "sglang.srt.server_args.ServerArgs", "sglang.srt.managers.scheduler", "sglang.srt.speculative"
_RUNNERS = "sglang.srt.model_executor.runner"
_OUT = "sglang.srt.managers.scheduler_components"
# In the order they run: server start, request arrival, one speculative round, its results and outputs.
HOOKS_IN_ORDER: List[Hook] = [
    Hook(f"{_SA}.add_cli_args", "AFTER", _add_cli_args, ["parser"],
         "adds ``--treespec-policy`` / ``-config`` / ``-token-cap`` / ``-classifier``"),
    Hook(f"{_SA}.from_cli_args", "AFTER", _from_cli_args, ["cls", "args"],
         "validates them (a default the server cannot draft stops it), exports the env"),
    Hook("sglang.srt.distributed.parallel_state.init_model_parallel_group", "AROUND", cpu_parallel_group,
         ["group_ranks", "local_rank", "backend", "use_pynccl", "use_custom_allreduce",
          "use_message_queue_broadcaster", "group_name", "use_mscclpp", "use_torch_symm_mem_allreduce",
          "recovered_rank", "rank_offset", "max_world_size"],
         "CPU (gloo) groups get no PyNccl (TP on the CPU)"),
    Hook(f"{_SPEC}.eagle_worker_v2.EagleDraftWorker.init_lm_head", "AROUND", _draft_head, ["self"],
         "the draft's class fits the algorithm (EAGLE-3 head <-> EAGLE3); ranks' settings and policy "
         "registries must agree; a token map under TP keeps each rank's shard of the hot head rows (:mod:`.ranks`)"),
    Hook(f"{_SPEC}.eagle_worker_v2.EagleDraftWorker._capture_cuda_graphs", "AFTER", _capture_selections, ["self"],
         "the selection's CUDA graph for every draft graph shape SGLang captured (:mod:`.select_graph`)"),
    Hook(f"{_SCHED}.Scheduler.init_metrics_collector", "AFTER", _scheduler_metrics, ["self"],
         "the plugin's Prometheus series beside SGLang's (:mod:`.metrics`)"),
    Hook("sglang.srt.managers.tokenizer_manager.TokenizerManager.init_metric_collector_watchdog", "AFTER",
         _tokenizer_metrics, ["self"], "the refused-requests counter"),
    Hook("sglang.srt.utils.common.build_server_info", "AFTER", _server_info, ["server_args", "scheduler_info"],
         "``/server_info`` gains a ``treespec`` section (:mod:`.info`)"),
    Hook("sglang.srt.sampling.sampling_params.SamplingParams.verify", "AFTER", _verify_sampling_params,
         ["self", "vocab_size"], "validates ``custom_params[\"treespec\"]``: a bad value fails that request only"),
    Hook("sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_request", "BEFORE",
         _handle_batch_request, ["self", "obj", "request", "request_states"],
         "marks malformed batch items instead of failing the whole call"),
    Hook(f"{_SCHED}.Scheduler._create_generation_req", "AFTER", _create_generation_req,
         ["self", "recv_req", "args", "kwargs"],
         "a marked item, or a policy this server cannot draft (a tree on a chain server, any on the multi-layer "
         "EAGLE worker), finishes at once as an abort carrying its message"),
    Hook(f"{_OUT}.dp_attn._spec_input_cuda_graph_compatible", "AFTER", _draft_graph_vote, ["local_batch"],
         "DP attention in chain mode: a treespec batch votes for an eager draft before the ranks' votes are reduced"),
    Hook(f"{_SPEC}.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation", "AROUND", _eagle_round,
         ["self", "batch", "on_publish", "grammar_barrier", "pp_proxy_tensors"],
         "opens the round (:class:`~.round.PluginRound`) for its draft, verify and draft extend; a ragged verify "
         "ran eagerly: the result's ``can_run_cuda_graph`` is False"),
    Hook(f"{_SPEC}.eagle_worker_v2.EagleDraftWorker.draft", "AROUND", _draft, ["self", "batch", "with_topology"],
         "stages each request's policy for this draft step (``round.step``); native when none"),
    Hook(f"{_SPEC}.eagle_worker_v2.EAGLEWorkerV2._build_trivial_verify_input", "AFTER", _trivial_round,
         ["self", "batch"], "adaptive speculation at 0 steps (no draft): the policies' stats of a root-only round"),
    Hook(f"{_SPEC}.eagle_worker_common.prepare_for_draft", "AFTER", _prepare_for_draft,
         ["draft_input", "req_to_token_pool", "batch", "cuda_graph_runner", "draft_model_runner", "topk",
          "num_steps", "target_translator", "num_draft_tokens"],
         "C2T chain stops draft eagerly unless the graph records their steps"),
    Hook(f"{_SPEC}.eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner.execute", "AFTER", _draft_replayed,
         ["self", "forward_batch"], "remembers the replayed draft graph's runner (its padded batch size)"),
    Hook(f"{_SPEC}.eagle_worker_v2.EagleDraftWorker.draft_forward", "AROUND", _draft_loop, ["self", "forward_batch"],
         "chain mode: the loop records each step's top log-prob and entropy for the C2T stop (eager, or into the "
         "captured graph with ``TREESPEC_CHAIN_STOP_GRAPH=1``; :mod:`.chain_stop`)"),
    Hook(f"{_SPEC}.eagle_utils.organize_draft_results", "AROUND", _organize,
         ["score_list", "token_list", "parents_list", "num_draft_token"],
         "SGLang's own selection (kept inside its draft graph); the pool and that selection are copied into "
         "per-shape buffers (:mod:`.draft_select`)"),
    Hook(_BUILD, "AROUND", _build_verify_input,
         ["batch", "draft_input", "parent_list", "top_scores_index", "draft_tokens", "draft_probs", "target_worker",
          "topk", "num_steps", "num_draft_tokens", "tree_mask_mode", "device"],
         "per-request trees on the pool after the draft (eager or replay), the batch's token cap, rank 0's tree; "
         "unlinks the filler nodes; ``round.step.keep``"),
    Hook(f"{_RUNNERS}.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph", "AROUND", eager_while_ragged,
         ["self", "forward_batch"], "a ragged verify runs eagerly"),
    Hook(f"{_RUNNERS}.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph", "AROUND", eager_while_ragged,
         ["self", "forward_batch"], "a ragged verify runs eagerly"),
    Hook("sglang.srt.model_executor.model_runner.ModelRunner.forward", "AROUND", _runner_forward,
         ["self", "forward_batch", "skip_attn_backend_init", "pp_proxy_tensors", "reinit_attn_backend",
          "split_forward_count"],
         "chain draft loop: records each step's statistics for the C2T stop; target verify: runs only the round's kept "
         "nodes where that pays (ragged verify, :mod:`.ragged`), and records the tokens it ran"),
    Hook("sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend.init_forward_metadata", "AFTER",
         amx_forward_metadata, ["self", "forward_batch"], "a uniform ragged verify's extend length (the plan's width)"),
    Hook("sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend._build_extend_metadata", "AROUND",
         amx_extend_metadata, ["self", "forward_batch"], "extend lengths and tree mask of a ragged verify"),
    Hook(f"{_SPEC}.eagle_info.EagleVerifyInput.generate_attn_arg_prefill", "AROUND", flashinfer_verify_args,
         ["self", "req_pool_indices", "paged_kernel_lens", "paged_kernel_lens_sum", "translator", "plan", "kind"],
         "FlashInfer ragged verify: the padded paged args compacted"),
    Hook(f"{_SPEC}.eagle_utils._verify_uses_greedy", "AROUND", _verify_uses_greedy,
         ["is_all_greedy", "is_cpu", "is_hip", "is_xpu", "use_rejection_sampling"],
         "on CPU, T > 0 takes the exact sampling verify (:mod:`.cpu.sampling`)"),
    Hook(f"{_SPEC}.eagle_utils.verify_tree_greedy_func", "AROUND", agree_verify,
         ["predicts", "accept_index", "accept_token_num", "candidates", "retrieve_index", "retrieve_next_token",
          "retrieve_next_sibling", "target_predict", "topk"],
         "several ranks: rank 0's greedy verify outcome on every rank"),
    Hook(f"{_OUT}.batch_result_processor.SchedulerBatchResultProcessor._resolve_spec_v2_tokens", "AFTER",
         _record_accepts, ["self", "result", "batch"], "records each round's accepted drafts"),
    Hook(f"{_OUT}.output_streamer.SchedulerOutputStreamer.is_request_level_customized_info_key", "AROUND",
         _request_level_key, ["self", "key"], "``treespec_*`` stats are per request"),
    Hook(f"{_OUT}.output_streamer._GenerationStreamAccumulator.accept", "AROUND", stream_accept, ["self", "req"],
         "a stream's chunks carry the rounds since the last chunk (:mod:`.stats`)"),
]
HOOKS: Dict[str, tuple] = {h.target: (h.kind, h.body, h.params) for h in HOOKS_IN_ORDER}
SIGNATURES: Dict[str, List[str]] = {h.target: h.params for h in HOOKS_IN_ORDER}


def hooks_table() -> str:
    """The module docstring's table: one row per hook, in the order they run."""
    rows = [f"| ``{'.'.join(h.target.split('.')[-2:])}`` | {h.kind} | {h.does} |" for h in HOOKS_IN_ORDER]
    return "\n".join(["| target | type | what it does |", "|---|---|---|"] + rows)


__doc__ = __doc__.replace("{table}", hooks_table())


def register_hooks() -> None:
    """Register every hook (called by the ``sglang.srt.plugins`` entry point in each process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    profile = profile_from_env()  # TREESPEC_PROFILE only: every body timed (:mod:`.profile`)
    for h in HOOKS_IN_ORDER:
        body = h.body if profile is None else profiled(profile, h.target, h.kind, h.body, _treespec_round)
        HookRegistry.register(h.target, body, getattr(HookType, h.kind))
    counting = register_counting(HookRegistry, HookType.AFTER, _treespec_round,  # TREESPEC_GRAPH_LOG only
                                 lambda: current() is not None)
    logger.info("treespec-sglang: registered %d hooks%s%s", len(HOOKS), " and CUDA-graph counting" if counting else "",
                ", each timed (TREESPEC_PROFILE)" if profile is not None else "")
