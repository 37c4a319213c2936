"""Several ranks, one tree: what the plugin does when a verify is shared by tensor-parallel ranks.

Every rank of the group that verifies together (SGLang's attention TP group: the TP group, or its
slice under DP attention) must build the same tree each round, or their KV caches and accepted tokens
drift apart and the next collective hangs. The plugin makes that true by construction:

- **Inputs agree** (:func:`settings_digest`, :func:`check_settings_agree`): the server defaults, the
  classifier registry's file hashes and the stats cap are hashed on every rank at start; a rank whose
  hash differs from rank 0's stops the server with a message naming both.
- **Decisions agree** (:func:`agree`): after its own selection each rank takes rank 0's per-round
  decision (the verify node order ``top_scores_index``, the draft tokens, the kept-node mask and the pool's
  parent table ``parent_list`` the tree's shape is built from: the token cap's shares and the ragged plan's
  sizes follow from them) in one int64 broadcast per round, ``bs * (2 (N - 1) + N + W)`` integers (W the
  table's width).
  The C2T chain cut is broadcast the same way (:func:`~treespec_sglang.plugin.chain_stop.keep_mask`).
- **Verify outcomes agree** (:func:`agree_verify`): SGLang broadcasts the verify result from rank 0 when it
  samples, but its greedy verify on CUDA relies on every rank computing bit-identical target argmaxes; TP
  ranks sum their all-reduces in different orders, so a near-tie can split them, accept different tokens,
  and hang the next collective. With a group larger than one, every rank takes rank 0's greedy outcome
  (predicted tokens, accepted indices, accepted counts) in one int64 broadcast per round, for native and
  treespec requests alike.
- **Groups on the CPU** (:func:`cpu_parallel_group`): SGLang builds a PyNccl communicator for every
  group outside NPU / XPU, which fails on a CPU-only host; CPU (gloo) groups get none.
- **Token map under TP** (:func:`shard_hot_head`): EAGLE with ``--speculative-token-map`` slices the
  target's LM head with global hot-token ids; under TP the head is vocab-parallel, so each rank gathers
  the full head, picks the hot rows, and keeps its own contiguous shard of them.

Debugging (operator environment, never a request): ``TREESPEC_RANK_DIGESTS=DIR`` makes every rank append
one line per round (hashes of the tree it selected and of the tree it verified) to ``DIR/rank<k>.txt``;
``TREESPEC_TEST_PERTURB_RANK=k`` reverses rank k's draft scores before its selection and its parent table
(a test-only fault: without :func:`agree` that rank would verify another tree);
``TREESPEC_TEST_PERTURB_VERIFY_RANK=k`` gives rank k's greedy verify the target's argmax tokens in reversed node
order, as if its verify logits had split from rank 0's at every node (without :func:`agree_verify` that rank
would accept other tokens). With ``TREESPEC_RANK_DIGESTS`` the verify outcomes are logged to
``DIR/verify-rank<k>.txt`` the same way.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
from typing import List, Optional, Sequence

import torch

from .settings import derived, env

logger = logging.getLogger("treespec_sglang.plugin")

__all__ = ["digests_dir", "verify_group", "group_size", "agree", "settings_digest", "check_settings_agree",
           "cpu_parallel_group", "shard_hot_head", "hot_rows", "BROADCASTS", "record_digest", "perturbed",
           "agree_verify"]

ENV_DIGESTS = "TREESPEC_RANK_DIGESTS"
ENV_PERTURB = "TREESPEC_TEST_PERTURB_RANK"
ENV_PERTURB_VERIFY = "TREESPEC_TEST_PERTURB_VERIFY_RANK"
BROADCASTS = {"count": 0, "bytes": 0}  # per process: the plugin's own per-round broadcasts


def verify_group():
    """The ``GroupCoordinator`` of the ranks that verify one batch together, as SGLang's own verify takes it
    (``eagle_utils.eagle_sample``): the attention TP group under DP attention, else the TP group (the same group
    unless attention context parallelism splits it: then every slice verifies the same batch). None when
    torch.distributed is not initialised (unit tests, a single process)."""
    try:
        runtime, dp_attention = _parallel_modules()
        parallel = runtime.get_parallel()
        return parallel.attn_tp_group if dp_attention.is_dp_attention_enabled() else parallel.tp_group
    except Exception:  # groups not built
        return None


@functools.lru_cache(maxsize=1)
def _parallel_modules():
    """SGLang's runtime context and DP-attention modules, imported once (a round asks for its verify group; their
    functions are read at each call)."""
    import sglang.srt.layers.dp_attention as dp_attention
    import sglang.srt.runtime_context as runtime

    return runtime, dp_attention


def group_size(group) -> int:
    """The number of ranks in ``group`` (a ``GroupCoordinator``; None: 1, alone)."""
    return 1 if group is None else int(getattr(group, "world_size", 1))


def agree(tensors: Sequence[torch.Tensor], group=None) -> List[torch.Tensor]:
    """Rank 0's values of ``tensors`` on every rank of ``group``, in one int64 broadcast.

    Parameters
    ----------
    tensors : integer or bool tensors, ``[bs, *]`` each (any shapes; same shapes on every rank)
    group : a ``GroupCoordinator`` (``verify_group()``) or None (a no-op)

    Returns
    -------
    The tensors with rank 0's values, same shapes and dtypes (the inputs themselves when alone).

    Example: rank 0 holds ``keep = [[1, 1, 0]]``, rank 1 ``[[1, 0, 1]]``: both return ``[[1, 1, 0]]``.
    """
    if group_size(group) <= 1:
        return list(tensors)
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])  # [sum of numels]
    group.broadcast(flat, src=0)
    BROADCASTS["count"] += 1
    BROADCASTS["bytes"] += flat.numel() * 8
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].view(t.shape).to(t.dtype))
        at += t.numel()
    return out


# ---------------------------------------------------------------------------- inputs agree
def settings_digest() -> str:
    """sha256 of what decides a request's policy on this rank: the server defaults, the registered policies in
    registration order (the row table's kind ids) with their pool stages, the classifier registry (name ->
    file hash), the stats cap, the selection (``TREESPEC_SELECT``), whether the draft graph records the chain
    stop's steps (``TREESPEC_CHAIN_STOP_GRAPH``: it changes what every rank captures) and the ragged verify's
    setting and tuning (``TREESPEC_RAGGED_VERIFY`` / ``_TUNING``: they decide the verify forward's shape). A bad
    value of any raises here, at server start."""
    from .chain_stop import chain_graph_enabled
    from .classifiers import classifier_digests
    from .config import server_defaults
    from .draft_select import selection_mode
    from .ragged_support import ragged_setting
    from .ragged_tuner import tuning
    from .stats import max_rounds

    from ..policies.registry import REGISTRY

    d = server_defaults()
    policies = [[n, r.pool_rule.stage if r.pool_rule else None] for n, r in REGISTRY.items()]  # order: kind ids
    blob = json.dumps({"policy": d.policy, "config": d.config, "token_cap": d.token_cap, "policies": policies,
                       "classifiers": classifier_digests(), "max_rounds": max_rounds(),
                       "selection": selection_mode(), "chain_stop_graph": chain_graph_enabled(),
                       "ragged": ragged_setting(), "ragged_tuning": str(tuning())},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def check_settings_agree(group=None) -> Optional[str]:
    """Raise ``RuntimeError`` if any rank of ``group`` hashes its settings differently from rank 0;
    returns the agreed digest (None when alone)."""
    if group_size(group) <= 1:
        return None
    mine = bytes.fromhex(settings_digest())
    t = torch.tensor(list(mine), dtype=torch.int64, device=_device(group))  # once, at start
    first = agree([t], group)[0]
    if not torch.equal(first, t):
        raise RuntimeError("treespec: this rank's settings (TREESPEC_POLICY / TREESPEC_CONFIG / TREESPEC_TOKEN_CAP, "
                           "the policies of TREESPEC_POLICY_MODULES, the classifier files of TREESPEC_CLASSIFIERS, "
                           "TREESPEC_STATS_MAX_ROUNDS, TREESPEC_SELECT, TREESPEC_CHAIN_STOP_GRAPH, "
                           "TREESPEC_RAGGED_VERIFY / _TUNING) "
                           "differ from rank "
                           f"0's: sha256 {mine.hex()[:16]} here vs {bytes(first.tolist()).hex()[:16]} on rank 0; "
                           "give every rank the same flags, environment and files")
    return mine.hex()


def _device(group) -> torch.device:
    """Where ``group``'s (a group of several ranks) broadcasts take their tensors: the CPU for gloo, else this
    rank's GPU."""
    if str(torch.distributed.get_backend(group.device_group)) == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


# ---------------------------------------------------------------------------- debugging
def _tree_hash(tensors) -> str:
    """16 hex digits of SHA-256 over each tensor's dtype and shape, then its bytes, in order: two trees
    whose bytes run together alike but split or shape differently (a ``[1, 4]`` table against a
    ``[2, 2]`` one) digest apart."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def record_digest(own: Sequence[torch.Tensor], agreed: Sequence[torch.Tensor], group=None, what: str = "") -> None:
    """With ``TREESPEC_RANK_DIGESTS=DIR``: append ``"<own hash> <agreed hash>"`` for this round to
    ``DIR/<what>rank<k>.txt`` (own: this rank's tree, or with ``what="verify-"`` its verify outcome; agreed:
    rank 0's, which it uses). Debug only: one host read per round."""
    out = digests_dir()
    if not out:
        return
    rank = group.rank_in_group if group is not None else 0
    with open(os.path.join(out, f"{what}rank{rank}.txt"), "a") as f:
        f.write(f"{_tree_hash(own)} {_tree_hash(agreed)}\n")


def perturbed(score_list: List[torch.Tensor], group=None) -> List[torch.Tensor]:
    """``TREESPEC_TEST_PERTURB_RANK=k``: rank k sees its draft scores reversed in order (a test-only
    fault that makes its own selection differ from rank 0's); every other rank sees them as they are."""
    if not _faulty(ENV_PERTURB, group):
        return score_list
    return [-s for s in score_list]


def perturbed_parent_list(parent_list: torch.Tensor, group=None) -> torch.Tensor:
    """``TREESPEC_TEST_PERTURB_RANK=k``: rank k's parent table ``[bs, W]`` reversed along each row (a test-only
    fault, as if its draft beam had gone another way: :func:`agree` must replace it); others' as it is. Only a rank
    other than 0 of a group of several (rank 0's table is the one every rank uses: reversed, the tree would be
    malformed, where reversed scores still give a valid one)."""
    faulty = _faulty(ENV_PERTURB, group) and group_size(group) > 1 and group.rank_in_group > 0
    return parent_list.flip(-1) if faulty else parent_list


def perturbed_rank(group) -> bool:
    """True on the rank ``TREESPEC_TEST_PERTURB_RANK`` names (a test-only fault: its own per-round choices must
    never be the ones used)."""
    return _faulty(ENV_PERTURB, group)


@derived
def digests_dir() -> str:
    """``TREESPEC_RANK_DIGESTS``: where :func:`record_digest` writes (empty: off)."""
    return env(ENV_DIGESTS)


@derived
def fault_ranks() -> dict:
    """``TREESPEC_TEST_PERTURB_RANK`` / ``_VERIFY_RANK`` -> the rank each makes faulty (None: none); test-only, read
    every round, parsed once per settings snapshot (and at start: :func:`.server_hooks.check_environment`)."""
    out = {}
    for name in (ENV_PERTURB, ENV_PERTURB_VERIFY):
        raw = env(name).strip()
        if raw and not (raw.isascii() and raw.isdigit()):
            raise ValueError(f"{name} (test-only) must be a rank number >= 0, got {raw!r}")
        out[name] = int(raw) if raw else None
    return out


def _faulty(name: str, group) -> bool:
    want = fault_ranks()[name]
    return want is not None and group is not None and group.rank_in_group == want


def agree_verify(original, *args, **kwargs):
    """``eagle_utils.verify_tree_greedy_func`` AROUND: SGLang's greedy tree verify, then rank 0's outcome on every
    rank of the verify group (one int64 broadcast; alone: SGLang's call untouched).

    Returns ``(predicts [bs * N] int32, accept_index [bs, S + 1] int32, accept_token_num [bs] int32)`` as SGLang's
    function does; rank 0's values when the group is larger than one.
    """
    group = verify_group()
    if group_size(group) <= 1:
        return original(*args, **kwargs)
    if _faulty(ENV_PERTURB_VERIFY, group):  # test-only: this rank's target argmaxes split from rank 0's
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.arguments["target_predict"] = bound.arguments["target_predict"].flip(-1).contiguous()
        args, kwargs = bound.args, bound.kwargs
    own = original(*args, **kwargs)
    agreed = agree(own, group)
    record_digest(own, agreed, group, "verify-")
    return tuple(agreed)


# ---------------------------------------------------------------------------- SGLang set-up hooks
def cpu_parallel_group(original, *args, **kwargs):
    """``init_model_parallel_group`` AROUND: a gloo (CPU) group gets no PyNccl communicator."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    if bound.arguments.get("backend") == "gloo":
        bound.arguments["use_pynccl"] = False
        bound.arguments["use_custom_allreduce"] = False
    return original(*bound.args, **bound.kwargs)


def hot_rows(vocab_rows: int, hot: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's hot-token ids when a ``hot``-id draft head is split over ``size`` ranks.

    The draft's logits are gathered rank by rank (rank 0's rows first), so rank ``r`` keeps hot rows
    ``[r * s, (r + 1) * s)``, ``s = ceil(len(hot) / size)``; the last rank repeats the last hot id to fill
    its shard (a repeated candidate has the same token, so verification stays exact).

    Parameters
    ----------
    vocab_rows : the target's vocabulary size (every id must be below it)
    hot : ``[n_hot]`` int64 target ids of the draft vocabulary

    Returns
    -------
    ``[s]`` int64 target ids of this rank's draft-head rows.

    Example: hot ``[7, 3, 9]``, 2 ranks: rank 0 ``[7, 3]``, rank 1 ``[9, 9]``.
    """
    if hot.numel() == 0 or int(hot.max()) >= vocab_rows or int(hot.min()) < 0:
        raise ValueError(f"speculative token map: ids must lie in [0, {vocab_rows}), got {hot.numel()} ids")
    s = -(-hot.numel() // size)
    padded = torch.cat([hot, hot[-1:].expand(s * size - hot.numel())])
    return padded[rank * s:(rank + 1) * s]


def shard_hot_head(original, self, *args, **kwargs):
    """``EagleDraftWorker.init_lm_head`` AROUND: with a token map under TP, the draft head is this rank's
    shard of the hot rows of the *full* target head (SGLang indexes the vocab-parallel shard with global
    ids). Everything else goes to SGLang's own code."""
    hot = getattr(self, "hot_token_id", None)
    group = _head_group()
    if hot is None or group_size(group) <= 1 or self.speculative_algorithm.is_eagle3():
        return original(self, *args, **kwargs)
    embed, head = self._resolve_shared_embed_and_head()
    if head is None:
        return original(self, *args, **kwargs)
    hot = torch.as_tensor(hot, dtype=torch.int64, device=head.device)
    vocab = int(self.target_worker.model_runner.model_config.vocab_size)
    full = group.all_gather(head.data, dim=0)[:vocab]  # [vocab, hidden]: the shards are contiguous vocab ranges
    rows = hot_rows(vocab, hot, group.rank_in_group, group.world_size)
    head = head.clone()
    head.data = full[rows].contiguous()
    # the draft's gathered logits are [n, world * s]: padded ids index past the map's end
    self.hot_token_id = torch.cat([hot, hot[-1:].expand(rows.numel() * group.world_size - hot.numel())])
    self.draft_runner.model.set_embed_and_head(embed, head)
    logger.info("treespec: TP %d, token map of %d ids: this rank's draft head holds %d hot rows",
                group.world_size, hot.numel(), rows.numel())


def _head_group():
    """The group the LM heads' vocabulary is split over, as SGLang builds them and its logits processor gathers
    the draft's logits: the attention TP group with ``--enable-dp-lm-head``, else the TP group. None outside a
    server."""
    try:
        parallel = _parallel_modules()[0].get_parallel()
        return parallel.attn_tp_group if parallel.enable_dp_lm_head else parallel.tp_group
    except Exception:
        return None
