"""The plugin's hooks that run outside a speculative round (no sglang import): server start (flags, the draft
head, metrics, ``/server_info``, CPU process groups), request arrival (validation, batch items, the scheduler's
refusal of what this server cannot draft) and the CPU's sampling verify switch. :mod:`.hooks` lists them with
the round's hooks, in the order they run.
"""

from __future__ import annotations

import logging
from typing import Dict

from ..policies.params import ChainParams
from .chain_stop import chain_graph_enabled
from .config import (ENV_CONFIG, ENV_POLICY, ENV_TOKEN_CAP, ServerDefaults, configure, draft_algorithm_mismatch,
                     load_config, parse_token_cap, server_defaults)
from .draft_select import check_selection
from .classifiers import parse_classifier_flags, registered
from .info import server_info
from .metrics import count_refused, enable_scheduler, enable_tokenizer
from .ragged_support import check_ragged_model, check_ragged_parallelism, ragged_setting
from .ragged_tuner import tuning
from .ranks import check_settings_agree, fault_ranks, shard_hot_head, verify_group
from .settings import env, freeze
from .stats import max_rounds
from .request import (ERROR_KEY, flag_invalid_items, request_params, request_shares, unsupported_reason,
                      validate_custom_params)

logger = logging.getLogger("treespec_sglang.plugin")


# ---------------------------------------------------------------------------- server start


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
    g.add_argument("--treespec-classifier", action="append", default=None, metavar="NAME=PATH",
                   help="register a C2T classifier file under NAME (repeatable); requests pick one with "
                        '{"classifier": "NAME"} and never name a file; "default" is always there (the shipped one '
                        'unless default=PATH maps it) and scores requests that name none')
    return result


def _from_cli_args(result, cls, args, *a, **k):
    policy = getattr(args, "treespec_policy", None)
    raw = getattr(args, "treespec_config", None)
    token_cap = getattr(args, "treespec_token_cap", None)
    classifiers = parse_classifier_flags(getattr(args, "treespec_classifier", None))
    thresholds = [getattr(args, n, 1.0) for n in ("speculative_accept_threshold_single",
                                                    "speculative_accept_threshold_acc")]
    if any(t is not None and t != 1.0 for t in thresholds):  # treespec flags or not: requests may carry policies
        logger.warning("treespec: --speculative-accept-threshold-single/acc != 1 relaxes verification; "
                       "sampling is then not lossless (greedy is unaffected)")
    if policy is None and raw is None and token_cap is None and not classifiers:
        return result
    # a flag sets its own setting; the others keep what their TREESPEC_* variable says (configure exports all)
    source, policy_source = "--treespec-config", "--treespec-policy"
    if policy is None:
        policy, policy_source = env(ENV_POLICY) or None, ENV_POLICY
    if raw is None:
        raw, source = env(ENV_CONFIG) or None, ENV_CONFIG
    elif not raw.strip():  # given, and empty: never read as "no parameters"
        raise ValueError(f"{source} must be a JSON object of the policy's parameters, got {raw!r}")
    if token_cap is None:
        token_cap = parse_token_cap(env(ENV_TOKEN_CAP) or None)
    config = load_config(raw, source) if raw else {}
    if not isinstance(config, dict):
        raise ValueError(f"{source} must be a JSON object of the policy's parameters, got {raw!r}")
    # the classifiers (a policy's parameters may name one) and the token cap (its errors name it) first; then the
    # policy, its errors naming where it came from; each validated (field and range) and exported to the env
    configure(None, None, token_cap, classifiers or None)
    try:
        defaults = configure(policy, config, token_cap)
    except ValueError as e:
        raise ValueError(f"{policy_source} / {source}: {e}") from None
    # a default this server cannot draft stops it here, not every request later
    reason = unsupported_reason(request_params(None, defaults), result)
    if reason is not None:
        raise ValueError(f"--treespec-policy {reason}")
    return result


_DRAFT_TOPK: Dict[str, int] = {}  # the draft worker's topk in this process (chain mode: 1)


def check_environment() -> None:
    """Every operator switch parsed once at server start (each raises ValueError naming its variable and the
    allowed values), so a bad value stops the start, not a round: ``TREESPEC_CHAIN_STOP_GRAPH`` and
    ``TREESPEC_RAGGED_VERIFY`` / ``_TUNING`` here, ``TREESPEC_SELECT`` in :func:`.draft_select.check_selection`,
    ``TREESPEC_PROFILE_OPS`` / ``_SYNC`` where the hooks are registered; ``TREESPEC_STATS_MAX_ROUNDS`` and
    ``TREESPEC_CLASSIFIERS`` there too and again here, for a process whose settings changed since (``configure``
    before ``sgl.Engine``): a single rank compares no settings digest, and its rounds read both."""
    chain_graph_enabled()
    ragged_setting()
    tuning()
    max_rounds()
    registered()
    fault_ranks()


def _draft_head(original, self, *args, **kwargs):
    freeze()  # the TREESPEC_* settings checked and agreed on below are the ones every round reads (.settings)
    check_environment()
    # the draft's class must fit the algorithm (an EAGLE-3 head under EAGLE runs and accepts nothing)
    runner = getattr(self, "draft_runner", None)
    algo = getattr(self, "speculative_algorithm", None)
    if runner is not None and algo is not None:
        reason = draft_algorithm_mismatch(type(runner.model).__name__, bool(algo.is_eagle3()))
        if reason is not None:
            raise ValueError(f"treespec: {reason}")
    check_ragged_parallelism(getattr(self, "server_args", None))
    check_ragged_model(getattr(getattr(self, "target_worker", None), "model_runner", None))
    # TREESPEC_POLICY / _CONFIG / _TOKEN_CAP parsed, and a default this server cannot draft (a tree policy on a
    # chain server, an engine-only policy) refused, at start: the flags were checked where they were parsed, the
    # variables alone (set without flags; a single rank compares no digest) only here, not by every request later
    defaults = server_defaults()
    reason = unsupported_reason(request_params(None, defaults), getattr(self, "server_args", None))
    if reason is not None:
        raise ValueError(f"treespec: the default policy ({ENV_POLICY}): {reason}")
    if getattr(self, "topk", None) == 1 and defaults.token_cap is not None:  # never a silent no-op
        raise ValueError(f"treespec: --treespec-token-cap ({ENV_TOKEN_CAP}) selects among a draft tree's nodes; this "
                         f"server drafts chains (--speculative-eagle-topk 1): start it without a token cap")
    # the spec worker is built on every rank after the groups: settings must agree before any round
    check_settings_agree(verify_group())
    if runner is not None and getattr(self, "topk", None) is not None:  # TREESPEC_SELECT valid, its kernel built
        check_selection(getattr(runner, "device", "cpu"), int(self.topk), int(self.speculative_num_steps),
                        int(self.speculative_num_draft_tokens))
    if getattr(self, "topk", None) is not None:
        _DRAFT_TOPK["topk"] = int(self.topk)
    return shard_hot_head(original, self, *args, **kwargs)


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


# ---------------------------------------------------------------------------- request arrival


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


def _req_shares(req) -> bool:
    """Whether a request shares the batch's token cap (:func:`.request.request_shares`), read from its
    ``custom_params`` once and cached on the request object (a request's parameters never change)."""
    s = getattr(req, "_treespec_shares", None)
    if s is None:
        s = request_shares(req.sampling_params)
        try:
            req._treespec_shares = s
        except AttributeError:  # a slotted request type: read again next time
            pass
    return s


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
        try:  # it may still sit in one decode batch (the overlap scheduler merges a prefill's requests before
            # its result finishes them): there it is SGLang's own request, its parameters never read again
            req._treespec_params = None
        except AttributeError:  # a slotted request type: nothing to keep it on
            pass
    return req


# ---------------------------------------------------------------------------- around a round


def _draft_graph_vote(result, local_batch, *args, **kwargs):
    # DP attention: each rank votes on the draft CUDA graph before SGLang min-reduces the votes across
    # ranks. Tree mode keeps the graph (the selection runs after it); in chain mode a batch whose C2T stop reads
    # the draft's steps (a chain with a beta) that the graph does not record (TREESPEC_CHAIN_STOP_GRAPH off) votes
    # no, so every rank agrees to draft eagerly: exactly where the draft hook turns the graph off without DP
    # attention (after the vote, turning it off on one rank would desynchronise the collectives). The vote does not
    # read the step count (adaptive speculation moves it after the vote): at one step, where the stop reads
    # nothing, SGLang captures no draft decode graph, so voting no there changes nothing
    if not result or local_batch is None or not getattr(local_batch, "reqs", None) \
            or not local_batch.forward_mode.is_decode() or _DRAFT_TOPK.get("topk", 1) > 1 or chain_graph_enabled():
        return result
    defaults = server_defaults()
    return not any(isinstance(p, ChainParams) and p.beta is not None
                   for p in (_req_params(r, defaults) for r in local_batch.reqs))


def _request_level_key(original, self, key, *args, **kwargs):
    return str(key).startswith("treespec_") or original(self, key, *args, **kwargs)


_CPU_SAMPLING = ("tree_speculative_sampling_target_only", "top_k_renorm_prob", "top_p_renorm_prob")


def _verify_uses_greedy(original, *args, **kwargs):
    # SGLang verifies greedily on CPU at any temperature (its sampling ops are None there). Give the
    # CPU the exact sampling walk instead, so speculative output at T > 0 follows the target.
    if not kwargs.get("is_cpu") or kwargs.get("use_rejection_sampling"):  # the rejection path is Triton's: not here
        return original(*args, **kwargs)
    import sys

    from .cpu import sampling

    eagle_utils = sys.modules["sglang.srt.speculative.eagle_utils"]
    for name in _CPU_SAMPLING:
        if getattr(eagle_utils, name, None) is None:
            setattr(eagle_utils, name, getattr(sampling, name))
    return original(*args, **{**kwargs, "is_cpu": False})
