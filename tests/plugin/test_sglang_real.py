"""The plugin against the real sglang==0.5.23 (CPU): discovery, hook application, signatures,
SGLang's own draft-tree functions vs our EAGLE-2, custom_params validation, server flags."""

import inspect
import logging
import os

import pytest
import torch

pytestmark = pytest.mark.sglang
sglang = pytest.importorskip("sglang")

from tests.helpers import PathDraft, drafting  # noqa: E402
from treespec_sglang.plugin import SGLANG_VERSION  # noqa: E402
from treespec_sglang.plugin.hooks import HOOKS, SIGNATURES  # noqa: E402

if sglang.__version__ != SGLANG_VERSION:
    pytest.skip(f"plugin pins sglang {SGLANG_VERSION}, found {sglang.__version__}", allow_module_level=True)


@pytest.fixture(scope="module")
def loaded():
    """sglang's own loader: discovers our entry point and applies every hook."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    torch._dynamo.config.disable = True  # SGLang torch.compile's select_top_k; run it eagerly on CPU

    records = []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record)

    h = Catch(level=logging.DEBUG)
    logging.getLogger("sglang").addHandler(h)
    try:
        load_plugins()
    finally:
        logging.getLogger("sglang").removeHandler(h)
    return HookRegistry, records


def test_entry_point_is_discovered():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="sglang.srt.plugins")}
    assert eps.get("treespec") == "treespec_sglang.plugin:register"


def test_every_hook_applies_without_failure(loaded):
    registry, records = loaded
    failed = [r.getMessage() for r in records if "Failed to apply hooks" in r.getMessage()]
    assert not failed, failed
    assert set(HOOKS) <= registry._patched


def test_hooked_signatures_match_what_the_hooks_assume(loaded):
    from pkgutil import resolve_name

    for target, expected in SIGNATURES.items():
        owner, attr = target.rsplit(".", 1)
        obj = resolve_name(owner)
        raw = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr)
        fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        params = list(inspect.signature(inspect.unwrap(fn)).parameters)
        assert params == expected, (target, params)


def sglang_draft_loop(draft, roots, topk, steps, N):
    """SGLang's own select_top_k_tokens + organize_draft_results on a path-keyed draft.

    hidden_states carry ids of frontier paths, so SGLang's own row selection tells us which
    parent each new frontier node came from."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    table = [(int(r),) for r in roots]
    hidden = torch.arange(len(roots), dtype=torch.float32)[:, None]  # root path ids
    probs = torch.stack([draft.logprobs(p).exp() for p in table])
    topk_p, topk_index = probs.topk(topk, dim=-1)
    scores, sl, tl, pl = None, [], [], []
    for i in range(steps):
        input_ids, hidden, scores, info = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, topk)
        sl.append(info[0]), tl.append(info[1]), pl.append(info[2])
        if i == steps - 1:
            break
        frontier = [table[int(h)] + (int(t),) for h, t in zip(hidden[:, 0], input_ids)]
        hidden = torch.arange(len(table), len(table) + len(frontier), dtype=torch.float32)[:, None]
        table += frontier
        probs = torch.stack([draft.logprobs(p).exp() for p in frontier])
        topk_p, topk_index = probs.topk(topk, dim=-1)
    return organize_draft_results(sl, tl, pl, N), (sl, tl, pl)


@pytest.mark.parametrize("topk,steps,N", [(3, 3, 8), (4, 4, 16), (2, 5, 9)])
def test_sglang_draft_functions_agree_with_our_eagle2(loaded, topk, steps, N):
    from treespec_sglang.policies import grow_tree

    draft = PathDraft(30, seed=topk + steps, sharpness=1.5)
    roots = torch.tensor([2, 9])
    (parent_list, top, toks), _ = sglang_draft_loop(draft, roots, topk, steps, N)
    ours = grow_tree([{"policy": "eagle2", "budget": N, "topk": topk, "depth": steps}] * 2, roots,
                     draft.root(roots), draft.expand)
    for b in range(2):
        parents = [-1]
        sel = top[b].tolist()
        for i in range(1, N):
            tb = sel[i - 1] // topk
            parents.append(0 if tb == 0 else sel.index(int(parent_list[b, tb])) + 1)
        assert ours.tokens[b].tolist() == [int(roots[b])] + toks[b].tolist()
        assert ours.parents[b].tolist() == parents


def test_custom_params_validate_on_real_sampling_params(loaded):
    from sglang.srt.sampling.sampling_params import SamplingParams

    from treespec_sglang.plugin import ServerDefaults, request_params

    ok = SamplingParams(max_new_tokens=8, custom_params={"treespec": {"policy": "salf", "budget": 60, "th": 0.6}})
    ok.verify(1000)
    assert request_params(ok, ServerDefaults()).th == 0.6
    bad = SamplingParams(max_new_tokens=8, custom_params={"treespec": {"policy": "talon", "mu": 3}})
    with pytest.raises(ValueError, match=r"custom_params\['treespec'\]: talon.mu must be in \[0.0, 1.0\], got 3"):
        bad.verify(1000)
    plain = SamplingParams(max_new_tokens=8)
    plain.verify(1000)  # untouched requests stay valid
    assert request_params(plain, ServerDefaults()) is None
    assert request_params(plain, ServerDefaults("talon", {"budget": 20})).budget == 20


def test_server_flags_are_added_and_exported(loaded, monkeypatch):
    import argparse

    from sglang.srt.server_args import ServerArgs

    from treespec_sglang.plugin.hooks import _from_cli_args

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "dummy", "--treespec-policy", "talon",
                              "--treespec-config", '{"budget": 30, "mu": 0.05}'])
    assert args.treespec_policy == "talon"
    for var in ("TREESPEC_POLICY", "TREESPEC_CONFIG"):  # restored (to unset) at teardown
        monkeypatch.setenv(var, "")
    _from_cli_args(None, ServerArgs, args)  # the AFTER hook on the parsed namespace
    assert os.environ["TREESPEC_POLICY"] == "talon"
    bad = parser.parse_args(["--model-path", "dummy", "--treespec-policy", "talon", "--treespec-config", '{"mu": 9}'])
    with pytest.raises(ValueError, match=r"talon.mu must be in"):
        _from_cli_args(None, ServerArgs, bad)
    from types import SimpleNamespace
    chain_server = SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=1)  # the built ServerArgs
    with pytest.raises(ValueError, match=r"--treespec-policy talon needs a draft tree"):  # at start, not per request
        _from_cli_args(chain_server, ServerArgs, args)


def test_token_cap_flag_is_added_validated_and_exported(loaded, monkeypatch):
    import argparse

    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    from treespec_sglang.plugin import server_defaults
    from treespec_sglang.plugin.hooks import _from_cli_args
    from treespec_sglang.plugin.request import request_shares

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for var in ("TREESPEC_POLICY", "TREESPEC_CONFIG", "TREESPEC_TOKEN_CAP"):
        monkeypatch.setenv(var, "")
    _from_cli_args(None, ServerArgs, parser.parse_args(["--model-path", "dummy", "--treespec-token-cap", "4"]))
    assert os.environ["TREESPEC_TOKEN_CAP"] == "4" and server_defaults().token_cap == 4
    assert not server_defaults().active  # a token cap alone sets no default policy
    with pytest.raises(ValueError, match=r"--treespec-token-cap must be an integer in \[1, 1024\]"):
        _from_cli_args(None, ServerArgs, parser.parse_args(["--model-path", "d", "--treespec-token-cap", "0"]))
    out = SamplingParams(max_new_tokens=8, custom_params={"treespec": {"policy": "talon", "token_cap": False}})
    out.verify(1000)
    assert not request_shares(out) and request_shares(SamplingParams(max_new_tokens=8))
    bad = SamplingParams(max_new_tokens=8, custom_params={"treespec": {"policy": "talon", "token_cap": 3}})
    with pytest.raises(ValueError, match=r"custom_params\['treespec'\]: token_cap must be true"):
        bad.verify(1000)




def test_organize_hook_keeps_sglang_selection_and_the_policies_run_on_the_stashed_pool(loaded):
    """The hooked organize_draft_results returns SGLang's own selection in and out of a draft step (it stays
    inside SGLang's draft graph) and copies the pool aside; the selection after the draft reads that copy
    and gives each request its policy tree."""
    import sglang.srt.speculative.eagle_utils as eu

    from treespec_sglang.plugin import draft_select, hooks
    from treespec_sglang.plugin.draft_select import read_pool, select_after_draft
    from treespec_sglang.policies import parse_spec

    draft = PathDraft(30, seed=5, sharpness=2.0)
    roots = torch.tensor([2, 9])
    native, (sl, tl, pl) = sglang_draft_loop(draft, roots, 4, 4, 12)
    again = eu.organize_draft_results(sl, tl, pl, 12)  # hooked, but no draft step active
    assert torch.equal(again[1], native[1])
    step = hooks.DraftStep([parse_spec({"policy": "talon", "budget": 6, "topk": 3}), None], 4)
    with drafting(step):
        out = eu.organize_draft_results(sl, tl, pl, 12)
    assert all(torch.equal(x, y) for x, y in zip(out, native))  # SGLang's selection, untouched
    pool = read_pool(2, 2, 4, 4, "cpu")
    assert torch.equal(pool.scores, torch.cat(sl, 1).flatten(1)) and torch.equal(pool.parent_list, native[0])
    assert torch.equal(draft_select._NATIVE[(2, 4 + 3 * 16, 1 + 3 * 4, "cpu")], native[1])  # stashed beside it
    top, toks = select_after_draft(step, None, native[1], native[2], 12, 4)
    assert step.sizes.tolist() == [6, 12]  # talon's 6-node tree; the native row keeps all N
    assert torch.equal(top[1], native[1][1]) and torch.equal(toks[1], native[2][1]) and step.keep[1].all()
    assert step.keep[0, 0] and int(step.keep[0].sum()) == 6


def test_draft_hook_stages_policies_and_reports_stats(loaded):
    """EagleDraftWorker.draft (hooked) with a stand-in body: the policies staged from real
    SamplingParams drive organize_draft_results, the verify chains lose the filler, and each
    request's stats land in req.customized_info (request-level meta_info keys)."""
    from types import SimpleNamespace

    import sglang.srt.speculative.eagle_utils as eu
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    from treespec_sglang.plugin import hooks
    from treespec_sglang.tree import DraftTree, sglang_retrive

    draft = PathDraft(30, seed=5, sharpness=2.0)
    roots = torch.tensor([2, 9])
    N, k = 12, 4
    _, (sl, tl, pl) = sglang_draft_loop(draft, roots, k, 4, N)
    reqs = [SimpleNamespace(sampling_params=SamplingParams(custom_params={"treespec": {"policy": "talon", "budget": 7,
                                                                                      "topk": 3}}),
                            customized_info=None),
            SimpleNamespace(sampling_params=SamplingParams(), customized_info=None)]
    seen = {}

    def build(**a):  # build_eagle_verify_input's part the hooks rely on: retrieve chains from the selection
        top, toks, parent_list = a["top_scores_index"], a["draft_tokens"], a["parent_list"]
        parents = []
        for b in range(2):
            sel, row = top[b].tolist(), [-1]
            for i in range(1, N):
                tb = sel[i - 1] // k
                row.append(0 if tb == 0 else sel.index(int(parent_list[b, tb])) + 1)
            parents.append(row)
        r = sglang_retrive(DraftTree.from_lists([[int(roots[b])] + toks[b].tolist() for b in range(2)], parents))
        vi = SimpleNamespace(retrieve_next_token=r.retrive_next_token.clone(),
                             retrieve_next_sibling=r.retrive_next_sibling.clone())
        seen.setdefault("chain", r.retrive_next_token.clone())
        return vi

    def body(self, batch):  # what the real draft() does around the hooked functions
        parent_list, top, toks = eu.organize_draft_results(sl, tl, pl, N)
        build(top_scores_index=top, draft_tokens=toks, parent_list=parent_list)  # SGLang's own tree
        return hooks._build_verify_input(build, batch, None, parent_list, top, toks, None, target_worker=None,
                                         topk=k, num_steps=4, num_draft_tokens=N, tree_mask_mode=None, device="cpu")

    worker = SimpleNamespace(topk=k, speculative_num_steps=4, speculative_num_draft_tokens=N)
    out = hooks._draft(body, worker, SimpleNamespace(reqs=reqs))
    hooks._PENDING.flush()  # what resolving the round's tokens does
    from treespec_sglang.plugin.stats import summary_of

    summary_of(reqs[0])  # what the output hook does when the request finishes
    assert reqs[0].customized_info == {"treespec_policy": ["talon"], "treespec_tree_sizes": [7],
                                       "treespec_verify_tokens": [], "treespec_accept_lengths": [], "treespec_summary": [
        {"rounds": 0, "tree_nodes": 7, "verified_tokens": 0, "accepted_tokens": 0, "lists_truncated": False}]}
    assert reqs[1].customized_info is None  # native request: untouched
    assert torch.equal(out.retrieve_next_token[1], seen["chain"][1])
    reach, stack = set(), [0]
    while stack:
        u = stack.pop()
        reach.add(u)
        c = int(out.retrieve_next_token[0, u])
        while c >= 0:
            stack.append(c)
            c = int(out.retrieve_next_sibling[0, c])
    assert len(reach) == 7
    # the installed draft() is our wrapper, and stats keys are request-level
    assert inspect.unwrap(EagleDraftWorker.draft) is not EagleDraftWorker.draft
    assert SchedulerOutputStreamer.is_request_level_customized_info_key(None, "treespec_tree_sizes")
    assert not SchedulerOutputStreamer.is_request_level_customized_info_key(None, "other")


def test_tree_batches_keep_the_draft_graph_and_chain_stops_draft_eagerly(loaded):
    """prepare_for_draft (hooked): a tree-mode step keeps SGLang's draft CUDA graph and remembers its runner
    (the selection reads the replay's pool); a chain-mode step with the C2T stop drafts eagerly."""
    from treespec_sglang.plugin import hooks
    from treespec_sglang.plugin.chain_stop import ChainStopper
    from treespec_sglang.policies import parse_spec

    runner = object()
    fake = ("fb", True, None)
    args = ("draft_input", "req_to_token_pool", "batch", runner)
    assert hooks._prepare_for_draft(fake, *args) == fake
    tree = hooks.DraftStep([None], 4)
    with drafting(tree):
        assert hooks._prepare_for_draft(fake, *args) == fake and tree.runner is runner
        assert hooks._prepare_for_draft(("fb", False, None), *args) == ("fb", False, None) and tree.runner is None
    chain = hooks.DraftStep([parse_spec({"policy": "chain", "beta": 0.5})], 1)
    chain.chain = ChainStopper(chain.params, 3, "cpu")
    with drafting(chain):
        assert hooks._prepare_for_draft(fake, *args) == ("fb", False, None)
    import sglang.srt.speculative.eagle_worker_common as common
    import sglang.srt.speculative.eagle_worker_v2 as v2

    assert v2.prepare_for_draft is common.prepare_for_draft  # the patch reached eagle_worker_v2's import
    assert inspect.unwrap(common.prepare_for_draft) is not common.prepare_for_draft


def test_worker_and_request_attributes_the_hooks_read(loaded):
    """The hooks read worker / request attributes by name: they must exist in this sglang."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    init = inspect.getsource(inspect.unwrap(EagleDraftWorker.__init__))
    for attr in ("self.topk =", "self.speculative_num_steps =", "self.speculative_num_draft_tokens =", "self.device ="):
        assert attr in init, attr
    assert "custom_params" in SamplingParams.__struct_fields__
    # the selection after a replayed draft reads the runner's padded batch size (draft_select)
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner

    assert "self.bs = bs" in inspect.getsource(EAGLEDraftCudaGraphRunner.execute)
    req_init = inspect.getsource(Req.__init__)
    assert "self.sampling_params = sampling_params" in req_init and "self.customized_info" in req_init


def test_accept_lengths_per_round_reach_customized_info(loaded):
    """SGLang's real (hooked) _resolve_spec_v2_tokens on a two-request result: the treespec request
    gets this round's accepted drafts appended; the native one is untouched; SGLang's own counters move."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    def req(params, info):
        return SimpleNamespace(_treespec_params=params, _treespec_drafted=params and "talon", customized_info=info,
                               is_retracted=False,
                               finished=lambda: False, grammar=None, kv=SimpleNamespace(kv_committed_len=10),
                               spec_verify_ct=0, spec_num_correct_drafts=0,
                               update_spec_correct_drafts_histogram=lambda n: None)

    from treespec_sglang.policies import parse_spec

    reqs = [req(parse_spec({"policy": "talon"}), {"treespec_tree_sizes": [7]}), req(None, None)]
    noop = lambda *a, **k: None  # noqa: E731
    proc = SimpleNamespace(metrics_reporter=SimpleNamespace(snapshot_spec_decode_metrics=noop),
                           model_worker=SimpleNamespace(on_verify_complete_cpu=noop), advance_grammar_fsm=noop)
    result = SimpleNamespace(next_token_ids=torch.arange(8), accept_lens=torch.tensor([3, 1]),
                             speculative_output_stride=4, speculative_num_draft_tokens=4,
                             num_non_draft_tokens_per_req=1, block_accept_lens=None, cap_lens=None)
    batch = SimpleNamespace(reqs=reqs)
    tokens = SchedulerBatchResultProcessor._resolve_spec_v2_tokens(proc, result, batch)
    assert tokens == [[0, 1, 2], [4]]
    info = reqs[0].customized_info
    assert info["treespec_tree_sizes"] == [7] and info["treespec_accept_lengths"] == [2]
    from treespec_sglang.plugin.stats import summary_of

    summary_of(reqs[0])
    assert info["treespec_summary"][0]["rounds"] == 1 and info["treespec_summary"][0]["accepted_tokens"] == 2
    assert reqs[1].customized_info is None and reqs[1].spec_num_correct_drafts == 0
    assert reqs[0].spec_num_correct_drafts == 2 and reqs[0].kv.kv_committed_len == 13


def test_cpu_verify_takes_the_sampling_path(loaded):
    """The hooked _verify_uses_greedy: on CPU, T > 0 no longer forces greedy, and the torch sampling ops
    fill the names SGLang leaves None there; greedy batches and other platforms are unchanged."""
    import sglang.srt.speculative.eagle_utils as eu

    from treespec_sglang.plugin.cpu import sampling

    kw = dict(is_cpu=True, is_hip=False, is_xpu=False, use_rejection_sampling=False)
    assert eu._verify_uses_greedy(is_all_greedy=True, **kw) is True
    assert eu._verify_uses_greedy(is_all_greedy=False, **kw) is False
    for name in ("tree_speculative_sampling_target_only", "top_k_renorm_prob", "top_p_renorm_prob"):
        assert getattr(eu, name) is getattr(sampling, name)
    assert eu._verify_uses_greedy(is_all_greedy=False, **{**kw, "is_cpu": False, "is_xpu": True}) is True


def test_a_malformed_batch_item_is_marked_not_raised(loaded):
    """The BEFORE hook on TokenizerManager._handle_batch_request marks bad items (also in the per-item
    objects GenerateReqInput already cached); validation passes them; the scheduler-side hook aborts
    exactly those requests with their message."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    from treespec_sglang.plugin import hooks
    from treespec_sglang.plugin.request import ERROR_KEY

    good = {"max_new_tokens": 4, "custom_params": {"treespec": {"policy": "talon", "budget": 8}}}
    bad = {"max_new_tokens": 4, "custom_params": {"treespec": {"policy": "talon", "budget": 0}}}
    obj = GenerateReqInput(input_ids=[[1, 2], [3, 4], [5, 6]], sampling_params=[good, bad, dict(good)])
    obj.normalize_batch_and_arguments()
    cached = obj[1]  # handed out before the hook runs (SGLang does this for rids)
    hooks._handle_batch_request(None, obj, None, {})
    assert bad["custom_params"].keys() == {"treespec"}  # the caller's dicts are not mutated
    flagged = [ERROR_KEY in (obj[i].sampling_params.get("custom_params") or {}) for i in range(3)]
    assert flagged == [False, True, False] and cached.sampling_params is obj.sampling_params[1]
    sp = SamplingParams(**obj[1].sampling_params)
    sp.verify(1000)  # marked: passes validation
    msg = obj[1].sampling_params["custom_params"][ERROR_KEY]
    assert "talon.budget must be in [1, 1024], got 0" in msg
    aborted = []
    req = SimpleNamespace(sampling_params=sp, set_finish_with_abort=lambda m, **kw: aborted.append((m, kw)))
    hooks._create_generation_req(req, None, None)
    assert aborted == [(msg, {"status_code": None, "err_type": "BadRequestError"})]
    ok = SimpleNamespace(sampling_params=SamplingParams(**obj[0].sampling_params),
                         set_finish_with_abort=lambda *a, **k: aborted.append("wrong"))
    hooks._create_generation_req(ok, None, None)
    assert len(aborted) == 1


def test_fuzzed_custom_params_through_the_real_hook(loaded):
    """Hypothesis-generated ``custom_params`` through SGLang's real ``SamplingParams.verify`` with the hook
    applied: a request is accepted with in-range params, or refused with ``ValueError`` naming the field."""
    hyp = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st
    from sglang.srt.sampling.sampling_params import SamplingParams

    from tests.policies.strategies import SPECS, check_valid
    from treespec_sglang.plugin import ServerDefaults, request_params

    @hyp.settings(max_examples=300, deadline=None)
    @hyp.given(st.one_of(SPECS.map(lambda s: {"treespec": s}), st.dictionaries(st.text(max_size=4), st.integers())))
    def run(custom):
        sp = SamplingParams(max_new_tokens=4, custom_params=custom)
        try:
            sp.verify(1000)
        except ValueError as e:
            assert str(e).startswith("custom_params['treespec']: "), e
            return
        p = request_params(sp, ServerDefaults())
        if p is not None:
            check_valid(p)

    run()


def test_a_treespec_decode_batch_votes_for_an_eager_draft_in_sglangs_dp_vote(loaded, monkeypatch):
    """SGLang's own (hooked) DP-attention vote with its ForwardMode: a decode batch carrying a treespec
    policy votes no before the ranks' votes are min-reduced; native and prefill batches keep SGLang's vote."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    monkeypatch.delenv("TREESPEC_POLICY", raising=False)

    def batch(custom, mode=ForwardMode.DECODE, compatible=True):
        req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom))
        return SimpleNamespace(reqs=[req], forward_mode=mode, spec_info=SimpleNamespace(cuda_graph_compatible=compatible))

    talon = {"treespec": {"policy": "talon", "budget": 8}}
    vote = dp_attn._spec_input_cuda_graph_compatible
    assert vote(batch(talon)) is False
    assert vote(batch(None)) is True
    assert vote(batch(None, compatible=False)) is False
    assert vote(batch(talon, mode=ForwardMode.EXTEND)) is True
    assert vote(None) is True
