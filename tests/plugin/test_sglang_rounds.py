"""The plugin's round hooks against the real sglang==0.5.23 (CPU): the organize and draft hooks, the draft graph
kept or not, the attributes the hooks read, the accept lengths and stats, the CPU sampling verify, the DP vote."""

import inspect

import pytest
import torch

pytestmark = pytest.mark.sglang
sglang = pytest.importorskip("sglang")

from tests.helpers import PathDraft, drafting  # noqa: E402
from tests.plugin.sglang_loop import sglang_draft_loop  # noqa: E402
from treespec_sglang.plugin import SGLANG_VERSION  # noqa: E402

if sglang.__version__ != SGLANG_VERSION:
    pytest.skip(f"plugin pins sglang {SGLANG_VERSION}, found {sglang.__version__}", allow_module_level=True)


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
    top, toks, _ = select_after_draft(step, None, native[1], native[2], 12, 4)
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
    info = reqs[0].customized_info  # the round's tree size recorded; its summary waits for the request's finish
    assert {k: v for k, v in info.items() if k != "treespec_summary"} == {
        "treespec_policy": ["talon"], "treespec_tree_sizes": [7], "treespec_verify_tokens": [],
        "treespec_accept_lengths": []}
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
        assert hooks._prepare_for_draft(fake, *args) == fake and tree.runner is None
        assert hooks._draft_replayed("out", runner, "fb") == "out" and tree.runner is runner  # the graph replayed
        # the next round's prepare allows the graph, but draft() drafts eagerly (a DSA target seeding its top-k):
        # no replay, so the selection reads this batch's own pool, not the last replay's padded rows
        assert hooks._prepare_for_draft(fake, *args) == fake and tree.runner is None
        assert hooks._prepare_for_draft(("fb", False, None), *args) == ("fb", False, None) and tree.runner is None
    assert hooks._draft_replayed("out", runner, "fb") == "out"  # outside a treespec draft: a pass-through
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
    # prepare_for_draft's "can run the graph" is not the last word: draft() may still draft eagerly, so the
    # runner is taken where the graph replays (EAGLEDraftCudaGraphRunner.execute), not from prepare_for_draft
    draft = inspect.getsource(inspect.unwrap(EagleDraftWorker.draft))
    assert "self.cuda_graph_runner.execute(" in draft and "can_run_decode_cuda_graph = False" in draft
    req_init = inspect.getsource(Req.__init__)
    assert "self.sampling_params = sampling_params" in req_init and "self.customized_info" in req_init


def test_accept_lengths_per_round_reach_customized_info(loaded):
    """SGLang's real (hooked) _resolve_spec_v2_tokens on a two-request result: the treespec request
    gets this round's accepted drafts appended; the native one is untouched; SGLang's own counters move."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    def req(params, info):
        return SimpleNamespace(_treespec_params=params, _treespec_drafted=params and "talon", customized_info=info,
                               is_retracted=False, finished_reason=None,
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
    # --speculative-use-rejection-sampling would take Triton's chain kernel on CPU tensors: SGLang's greedy stays
    assert eu._verify_uses_greedy(is_all_greedy=False, **{**kw, "use_rejection_sampling": True}) is True


def test_a_treespec_decode_batch_votes_for_an_eager_draft_in_sglangs_dp_vote(loaded, monkeypatch):
    """SGLang's own (hooked) DP-attention vote with its ForwardMode: a decode batch carrying a chain whose C2T stop
    reads the draft's steps votes no before the ranks' votes are min-reduced; native and prefill batches, and a
    chain cut by its length alone, keep SGLang's vote."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    monkeypatch.delenv("TREESPEC_POLICY", raising=False)

    def batch(custom, mode=ForwardMode.DECODE, compatible=True):
        req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom))
        return SimpleNamespace(reqs=[req], forward_mode=mode, spec_info=SimpleNamespace(cuda_graph_compatible=compatible))

    monkeypatch.delenv("TREESPEC_CHAIN_STOP_GRAPH", raising=False)
    talon = {"treespec": {"policy": "chain", "length": 3, "beta": 0.4}}  # a stopping chain
    vote = dp_attn._spec_input_cuda_graph_compatible
    assert vote(batch(talon)) is False
    assert vote(batch({"treespec": {"policy": "chain", "length": 3}})) is True
    assert vote(batch(None)) is True
    assert vote(batch(None, compatible=False)) is False
    assert vote(batch(talon, mode=ForwardMode.EXTEND)) is True
    assert vote(None) is True


class LiveReq:
    """SGLang 0.5.23's ``Req`` as the accept hook reads it: ``finished()`` is ``finished_reason is not None``."""

    def __init__(self, drafted, finished_reason=None, is_retracted=False):
        self._treespec_drafted, self.finished_reason, self.is_retracted = drafted, finished_reason, is_retracted
        self.customized_info, self.sampling_params = None, None

    def finished(self):
        return self.finished_reason is not None


@pytest.mark.parametrize("done", [None, "finished", "retracted", "both"])
def test_finished_and_retracted_requests_record_no_accept_length(done):
    """The accept hook: a request that finished (an earlier round's EOS under the overlap scheduler) or was
    retracted commits nothing this round, so no accept length is recorded for it; the others get theirs."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import columns, hooks

    reqs = [LiveReq("talon"), LiveReq("talon", finished_reason=object() if done in ("finished", "both") else None),
            LiveReq("eagle2", is_retracted=done in ("retracted", "both")), LiveReq(None)]
    columns._COLUMNS[0] = None  # no cached batch: the names are read off the requests
    hooks._record_accepts(None, None, SimpleNamespace(num_correct_drafts_per_req_cpu=[3, 2, 1, 0]),
                          SimpleNamespace(reqs=reqs))
    got = [(r.customized_info or {}).get("treespec_accept_lengths") for r in reqs]
    assert got == [[3], None if done in ("finished", "both") else [2], None if done in ("retracted", "both") else [1],
                   None]


def test_a_retracted_round_is_cut_when_processed_so_the_lists_stay_aligned():
    """Under the overlap scheduler a request retracted after its round was drafted and verified commits nothing
    for it, then runs on after a new prefill: that round's tree size and verify tokens go when its result is
    processed, so at the finish the three lists are the committed rounds' (cutting from the end then would drop
    the last good round instead)."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import columns, hooks
    from treespec_sglang.plugin.stats import record_rounds, summary_of

    req = LiveReq("talon")
    columns._COLUMNS[0] = None

    def round_(size, verified, accepted, retracted=False):
        record_rounds([req], ["talon"], "treespec_tree_sizes", [size])
        record_rounds([req], ["talon"], "treespec_verify_tokens", [verified])
        req.is_retracted = retracted
        hooks._record_accepts(None, None, SimpleNamespace(num_correct_drafts_per_req_cpu=[accepted]),
                              SimpleNamespace(reqs=[req]))
        req.is_retracted = False

    round_(5, 8, 2)
    round_(6, 8, 3, retracted=True)  # its result never commits
    round_(7, 8, 1)
    req.finished_reason = "stop"
    summary = summary_of(req)
    info = req.customized_info
    assert info["treespec_tree_sizes"] == [5, 7] and info["treespec_accept_lengths"] == [2, 1]
    assert info["treespec_verify_tokens"] == [8, 8] and summary["rounds"] == 2 and summary["tree_nodes"] == 12


def test_the_selection_graphs_are_captured_right_after_sglangs_draft_graphs(loaded, monkeypatch):
    """``EagleDraftWorker._capture_cuda_graphs`` (SGLang's draft graphs, at start) is hooked: after it, the selection
    graphs of the captured shapes, at the worker's topk and N (``draft_select.capture_selections``)."""
    from types import SimpleNamespace

    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    from treespec_sglang.plugin import hooks

    assert inspect.unwrap(EagleDraftWorker._capture_cuda_graphs) is not EagleDraftWorker._capture_cuda_graphs
    seen = []
    monkeypatch.setattr(hooks, "capture_selections", lambda topk, n: seen.append((topk, n)) or 3)
    worker = SimpleNamespace(topk=4, speculative_num_draft_tokens=16)
    assert hooks._capture_selections("out", worker) == "out" and seen == [(4, 16)]
