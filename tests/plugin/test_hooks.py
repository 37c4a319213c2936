"""``plugin/hooks.py`` on stand-ins (with SGLang's objects: ``test_sglang_rounds.py``, ``test_chain_stop.py``): the
selection and chain-cut graphs captured after SGLang's draft graphs at start, the label a round gives the CUDA-graph
counter, the module docstring's table, ``register_hooks``, and each round hook handing SGLang its arguments unchanged
and doing its part: the draft hook's three ways (SGLang's own chain, SGLang's own trees with the policies' stats, a
policy step), the stash, the verify input (a policy's selection, a chain's cut), the target forward (ragged, the
chain loop's step statistics) and the accepted tokens."""

import logging
from types import SimpleNamespace

import pytest
import torch

from treespec_sglang.plugin import hooks
from treespec_sglang.plugin.round import DraftStep, current, drafting_step, opened


@pytest.fixture
def captures(monkeypatch):
    """What each capture was asked for (``("select", topk, N)`` / ``("cut", steps, N)``); each reports ``made``
    graphs."""
    seen, made = [], {"select": 3, "cut": 2}
    monkeypatch.setattr(hooks, "capture_selections", lambda topk, n: seen.append(("select", topk, n)) or made["select"])
    monkeypatch.setattr(hooks, "capture_cuts", lambda steps, n: seen.append(("cut", steps, n)) or made["cut"])
    return seen, made


def worker(topk):
    return SimpleNamespace(topk=str(topk), speculative_num_steps=5, speculative_num_draft_tokens=6)


@pytest.mark.parametrize("topk, want", [(1, [("select", 1, 6), ("cut", 5, 6)]), (2, [("select", 2, 6)]),
                                        (4, [("select", 4, 6)])])
def test_a_chain_server_also_captures_its_cut_graphs(captures, caplog, topk, want):
    with caplog.at_level(logging.INFO, logger="treespec_sglang.plugin"):
        assert hooks._capture_selections("out", worker(topk)) == "out"
    assert captures[0] == want
    lines = ["treespec-sglang: captured the selection graph of 3 draft graph shapes",
             "treespec-sglang: captured the chain cut graph of 2 draft graph shapes"]
    assert [r.getMessage() for r in caplog.records] == lines[:len(want)]


def test_nothing_captured_logs_nothing(captures, caplog):
    captures[1].update(select=0, cut=0)
    with caplog.at_level(logging.INFO, logger="treespec_sglang.plugin"):
        hooks._capture_selections(None, worker(1))
    assert len(captures[0]) == 2 and caplog.records == []


def test_the_graph_counter_labels_a_round_treespec_only_when_a_request_carries_a_policy():
    assert hooks._treespec_round() is False  # no round open
    with opened([SimpleNamespace(_treespec_params=None)]):
        assert hooks._treespec_round() is False
    with opened([SimpleNamespace(), SimpleNamespace(_treespec_params="talon")]):
        assert hooks._treespec_round() is True


def test_the_docstring_table_has_one_row_per_hook_in_the_order_they_run():
    table = hooks.hooks_table()
    lines = table.split("\n")
    assert lines[:2] == ["| target | type | what it does |", "|---|---|---|"]
    assert len(lines) == 2 + len(hooks.HOOKS_IN_ORDER)
    for line, h in zip(lines[2:], hooks.HOOKS_IN_ORDER):
        cls_or_module, name = h.target.split(".")[-2:]
        assert line == f"| ``{cls_or_module}.{name}`` | {h.kind} | {h.does} |"
    assert table in hooks.__doc__ and "{table}" not in hooks.__doc__


@pytest.mark.parametrize("graph_log, profile, tail", [
    (False, False, ""), (True, False, " and CUDA-graph counting"), (False, True, ", each timed (TREESPEC_PROFILE)"),
    (True, True, " and CUDA-graph counting, each timed (TREESPEC_PROFILE)")])
def test_register_hooks_registers_the_table_then_the_graph_counters_and_says_so(hook_registry, monkeypatch, tmp_path,
                                                                                caplog, graph_log, profile, tail):
    from treespec_sglang.plugin import graph_log as G

    timed = []
    monkeypatch.setattr(hooks, "profiled", lambda *a: timed.append(a) or ("timed", a[3]))
    if graph_log:
        monkeypatch.setenv("TREESPEC_GRAPH_LOG", str(tmp_path / "graphs"))
    if profile:
        monkeypatch.setenv("TREESPEC_PROFILE", str(tmp_path / "profile"))
    with caplog.at_level(logging.INFO, logger="treespec_sglang.plugin"):
        hooks.register_hooks()
    table = [(h.target, ("timed", h.body) if profile else h.body, h.kind) for h in hooks.HOOKS_IN_ORDER]
    counters = [(t, body, "AFTER") for t, body in G.RUNNERS.items()] if graph_log else []
    assert hook_registry == table + counters
    if profile:  # each body timed as its target and kind, labelled by the round's treespec test
        assert [a[1:] for a in timed] == [(h.target, h.kind, h.body, hooks._treespec_round)
                                          for h in hooks.HOOKS_IN_ORDER]
    assert [r.getMessage() for r in caplog.records] == [f"treespec-sglang: registered {len(hooks.HOOKS)} hooks{tail}"]
    if graph_log:  # the counters label a round by the plugin's own tests
        assert G._LABEL["treespec_round"] is hooks._treespec_round and G._LABEL["in_round"]() is False
        with opened([]):
            assert G._LABEL["in_round"]() is True


def test_a_draft_loop_of_a_worker_without_topk_runs_sglangs_loop_alone():
    seen = []
    hooks._draft_loop(lambda self, fb, *a, **k: seen.append((self, fb, a, k)), "worker", "fb", 1, x=2)
    assert seen == [("worker", "fb", (1,), {"x": 2})]


# ---------------------------------------------------------------------------- a round's hooks hand SGLang its arguments
def native_req():
    return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None))


class Original:
    """SGLang's wrapped method: records each call's arguments and the round open during it (``calls``), and the
    draft step drafting then (``steps``)."""

    def __init__(self, out="out"):
        self.calls, self.steps, self.out = [], [], out

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs, current()))
        self.steps.append(drafting_step())
        return self.out


def test_a_round_opens_for_sglangs_round_on_its_requests_and_closes_after():
    batch, sglang = SimpleNamespace(reqs=[native_req()]), Original()
    assert hooks._eagle_round(sglang, "worker", batch, 1, flag=2) == "out"
    ((args, kwargs, r),) = sglang.calls
    assert (args, kwargs) == (("worker", batch, 1), {"flag": 2}) and r.reqs is batch.reqs and current() is None


@pytest.mark.parametrize("batch", [SimpleNamespace(reqs=[native_req(), native_req()]), SimpleNamespace()],
                         ids=["native requests", "no requests"])
def test_a_native_draft_outside_a_round_is_sglangs_in_a_round_of_its_own(monkeypatch, batch):
    from treespec_sglang.plugin.config import ServerDefaults

    monkeypatch.setattr(hooks, "server_defaults", ServerDefaults)  # no server default: native
    sglang = Original()
    assert hooks._draft(sglang, "worker", batch, 1, flag=2) == "out"
    ((args, kwargs, r),) = sglang.calls
    assert (args, kwargs) == (("worker", batch, 1), {"flag": 2})
    assert r is not None and r.reqs is getattr(batch, "reqs", None) and r.step is None


def test_a_chain_draft_loop_that_records_hands_sglang_its_arguments(monkeypatch):
    from treespec_sglang.plugin.chain_stop import recording_loop

    monkeypatch.setattr(hooks, "capturing", lambda *a: True)  # SGLang captures the loop's graph, recording
    monkeypatch.setattr(hooks, "chain_graph_enabled", lambda: True)
    seen = []
    worker = SimpleNamespace(topk=1, speculative_num_steps=3)
    hooks._draft_loop(lambda *a, **k: seen.append((a, k, recording_loop().steps)), worker, "fb", 1, flag=2)
    assert seen == [((worker, "fb", 1), {"flag": 2}, 3)]


def test_sglangs_selection_is_stashed_only_in_a_treespec_draft_or_a_capture(monkeypatch):
    stashed = []
    monkeypatch.setattr(hooks, "stash_pool", lambda *a: stashed.append(a))
    monkeypatch.setattr(hooks, "capturing", lambda t=None: t == "captured scores")
    sglang = Original(out=("parents", "top", "tokens"))
    assert hooks._organize(sglang, ["scores", "s1"], "tokens", "parents", 8, 1, flag=2) == sglang.out
    assert sglang.calls[0][:2] == ((["scores", "s1"], "tokens", "parents", 8, 1), {"flag": 2}) and stashed == []
    hooks._organize(sglang, ["captured scores", "s1"], "tokens", "parents", 8)
    assert stashed == [(["captured scores", "s1"], "tokens", "parents", "top")]


def test_a_native_verify_input_is_sglangs_and_a_policy_step_replaces_its_selection(monkeypatch):
    sglang = Original(out=SimpleNamespace(retrieve_next_token=None))
    assert hooks._build_verify_input(sglang, "batch", flag=2) is sglang.out
    assert sglang.calls[0][:2] == (("batch",), {"flag": 2})
    picked = []
    monkeypatch.setattr(hooks, "select_after_draft", lambda *a: picked.append(a) or ("TOP", "TOKENS", "PARENTS"))
    names = hooks.SIGNATURES[hooks._BUILD]
    args = [f"<{n}>" for n in names]
    with opened([]) as r:
        r.step, r.drafting = DraftStep([None], 4, runner=SimpleNamespace(bs=8)), True
        hooks._build_verify_input(sglang, *args[:3], **dict(zip(names[3:], args[3:])))
    got = sglang.calls[1][1]
    assert sglang.calls[1][0] == () and got == {**dict(zip(names, args)), "top_scores_index": "TOP",
                                                "draft_tokens": "TOKENS", "parent_list": "PARENTS"}
    assert picked == [(r.step, 8, "<top_scores_index>", "<draft_tokens>", "<num_draft_tokens>", "<num_steps>",
                       "<parent_list>")]


def verify_batch_mode(target_verify: bool):
    return SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: target_verify))


def test_a_target_forward_outside_a_treespec_round_is_sglangs():
    sglang = Original()
    fb = verify_batch_mode(True)
    assert hooks._runner_forward(sglang, "runner", fb, 1, flag=2) == "out"  # no round open
    assert sglang.calls[0][:2] == (("runner", fb, 1), {"flag": 2})


def test_a_treespec_verify_forward_runs_ragged_and_records_its_tokens(monkeypatch):
    ran, recorded = [], []
    monkeypatch.setattr(hooks, "ragged_verify_forward", lambda *a, **k: ran.append((a, k)) or ("out", [3, 4]))
    monkeypatch.setattr(hooks, "record_rounds", lambda *a: recorded.append(a))
    reqs = [SimpleNamespace(_treespec_drafted="talon"), SimpleNamespace(_treespec_drafted=None)]
    fb = verify_batch_mode(True)
    with opened(reqs) as r:
        r.step = DraftStep([None, None], 4)
        r.step.keep = torch.ones(2, 4, dtype=torch.bool)
        assert hooks._runner_forward("sglang", "runner", fb, 1, flag=2) == "out"
    assert ran == [(("sglang", "runner", fb, r.step.keep, 1), {"flag": 2})]
    assert recorded == [(reqs, ["talon", None], "treespec_verify_tokens", [3, 4])]


@pytest.mark.parametrize("verified, graph, want", [([3, 4], True, False), ([4, 4], True, True),
                                                    ([3, 4], False, False), (None, True, True)],
                         ids=["ragged", "padded", "ragged, no graph anyway", "native round"])
def test_a_round_whose_verify_ran_ragged_reports_no_cuda_graph(monkeypatch, verified, graph, want):
    """SGLang decides the verify's graph before the forward (``eagle_prepare_for_verify``); a ragged verify then
    runs eagerly, and the round's result says so (the decode log's ``cuda graph``, ``sglang:is_cuda_graph``)."""
    monkeypatch.setattr(hooks, "ragged_verify_forward", lambda *a, **k: ("out", verified))
    monkeypatch.setattr(hooks, "record_rounds", lambda *a: None)
    result = SimpleNamespace(can_run_cuda_graph=graph)

    def sglang_round(worker, batch):
        if verified is not None:  # a treespec round: its selection kept some nodes
            current().step = DraftStep([None, None], 4)
            current().step.keep = torch.ones(2, 4, dtype=torch.bool)
        assert hooks._runner_forward(lambda *a, **k: "out", "runner", verify_batch_mode(True)) == "out"
        return result

    assert hooks._eagle_round(sglang_round, "worker", SimpleNamespace(reqs=[native_req(), native_req()])) is result
    assert result.can_run_cuda_graph is want


@pytest.mark.parametrize("batch", [SimpleNamespace(), SimpleNamespace(reqs=None)], ids=["no reqs", "reqs None"])
def test_a_root_only_round_of_a_batch_without_requests_records_nothing(monkeypatch, batch):
    """Adaptive speculation at 0 steps on a batch that carries no requests (as every draft hook reads them)."""
    recorded = []
    monkeypatch.setattr(hooks, "_record_sglangs_trees", lambda *a: recorded.append(a))
    assert hooks._trivial_round("verify input", "worker", batch) == "verify input"
    assert recorded == []


def test_a_recording_chain_loop_records_every_step_but_the_last(monkeypatch):
    recorded = []
    loop = SimpleNamespace(i=0, steps=3)
    monkeypatch.setattr(hooks, "recording_loop", lambda: loop)
    monkeypatch.setattr(hooks, "record_step", lambda logits, i, steps: recorded.append((logits, i, steps)))
    logits = torch.zeros(1, 5)
    out = SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits))
    for _ in range(4):
        hooks._runner_forward(lambda *a, **k: out, "runner", verify_batch_mode(False))
    assert recorded == [(logits, 0, 3), (logits, 1, 3)] and loop.i == 2
    loop.i = 0
    hooks._runner_forward(lambda *a, **k: SimpleNamespace(), "runner", None)  # an output without logits
    assert loop.i == 0 and len(recorded) == 2


def test_accepts_without_sglangs_host_counts_record_nothing():
    assert hooks._record_accepts("result", None, SimpleNamespace(), None) == "result"


def test_only_a_retracted_unfinished_request_has_its_round_cut(monkeypatch):
    cut, recorded = [], []
    monkeypatch.setattr(hooks, "uncommitted", cut.append)
    monkeypatch.setattr(hooks, "record_rounds", lambda *a: recorded.append(a))

    def req(retracted, finished):
        return SimpleNamespace(_treespec_drafted="talon", is_retracted=retracted,
                               finished_reason="stop" if finished else None, finished=lambda: finished)
    reqs = [req(False, True), req(False, False), req(True, False), req(True, True)]
    hooks._record_accepts("result", None, SimpleNamespace(num_correct_drafts_per_req_cpu=[1, 2, 3, 4]),
                          SimpleNamespace(reqs=reqs))
    assert cut == [reqs[2]]
    assert recorded == [(reqs, [None, "talon", None, None], "treespec_accept_lengths", [1, 2, 3, 4])]


@pytest.mark.parametrize("reads_steps, runner, group, rows", [(True, SimpleNamespace(bs=8), "the group", 8),
                                                              (False, None, None, None)])
def test_a_chain_verify_input_is_cut_per_row_then_unlinked(monkeypatch, reads_steps, runner, group, rows):
    """A cut read off the draft's steps takes rank 0's (the verify group); one from the rows' lengths needs none;
    a replay cuts its padded batch."""
    cut, unlinked = [], []
    keep = torch.ones(2, 5, dtype=torch.bool)
    monkeypatch.setattr(hooks, "verify_group", lambda: "the group")
    monkeypatch.setattr(hooks, "chain_keep", lambda *a: cut.append(a) or (keep,))
    monkeypatch.setattr(hooks, "unlink", lambda *a: unlinked.append(a))
    result = SimpleNamespace(retrieve_next_token=torch.zeros(2, 5), retrieve_next_sibling="siblings")
    chain = SimpleNamespace(reads_steps=reads_steps)
    with opened([]) as r:
        r.step, r.drafting = DraftStep([None, None], 1, chain=chain, runner=runner), True
        assert hooks._verify_input(result) is result
    assert cut == [(chain, rows, 5, group)] and r.step.keep is keep
    assert unlinked == [(result.retrieve_next_token, "siblings", keep)]


def test_a_round_of_a_batch_without_requests_has_none():
    sglang = Original()
    hooks._eagle_round(sglang, "worker", SimpleNamespace())
    assert sglang.calls[0][2].reqs is None


# ---------------------------------------------------------------------------- the draft hook's three ways
class Columns:
    """A batch's policy columns as the draft hook reads them (:func:`.columns.batch_columns`)."""

    def __init__(self, chain_active=False, params=("talon params",)):
        self.any_policy, self.reqs, self.shares = True, ("req",), (True,)
        self.params, self.defaults = ("row params",), SimpleNamespace(token_cap=12)
        self.chain_active, self.tree_params, self.asked = chain_active, params, []

    def chain_stopper(self, steps, device):
        self.asked.append(("chain", steps, device))
        return SimpleNamespace(active=self.chain_active)

    def selection(self, n, steps):
        self.asked.append(("selection", n, steps))
        return self.tree_params, "tokens"

    def drafted(self):
        return ("talon",)

    def whole_trees(self, n):
        self.asked.append(("whole", n))
        return "whole tokens"


@pytest.fixture
def draft_round(monkeypatch):
    """The draft hook with these columns, its pending sizes, stats and series recorded: ``(columns, seen)``."""
    from treespec_sglang.plugin.config import ServerDefaults

    cols, seen = Columns(), {"pushed": [], "recorded": [], "series": []}
    monkeypatch.setattr(hooks, "batch_columns", lambda reqs, defaults: cols)
    monkeypatch.setattr(hooks, "server_defaults", ServerDefaults)
    monkeypatch.setattr(hooks, "_PENDING", SimpleNamespace(flush=lambda: None,
                                                           push=lambda *a: seen["pushed"].append(a)))
    monkeypatch.setattr(hooks, "record_rounds", lambda *a: seen["recorded"].append(a))
    monkeypatch.setattr(hooks, "scheduler_series",
                        lambda: SimpleNamespace(verify_forward=lambda ragged: seen["series"].append(ragged)))
    return cols, seen


def test_a_chain_draft_without_a_stop_is_sglangs_and_records_the_policies_stats(draft_round):
    cols, seen = draft_round
    sglang, worker = Original(), SimpleNamespace(topk=1, speculative_num_steps=4, speculative_num_draft_tokens=5)
    with opened(["req"]) as r:
        assert hooks._draft(sglang, worker, "batch", 1, flag=2) == "out"
    assert sglang.calls[0][:2] == ((worker, "batch", 1), {"flag": 2}) and sglang.steps == [None]
    assert cols.asked == [("chain", 4, "cpu"), ("whole", 5)] and r.reqs is cols.reqs  # no device attribute: the CPU's
    assert seen["pushed"] == [(("req",), ("talon",), "whole tokens")]
    assert seen["recorded"] == [(("req",), ("talon",), "treespec_verify_tokens", "whole tokens")]
    assert seen["series"] == [False]


def test_a_tree_draft_of_sglangs_own_trees_records_the_policies_stats_as_padded(draft_round):
    cols, seen = draft_round
    cols.tree_params = None
    sglang, worker = Original(), SimpleNamespace(topk=4, speculative_num_steps=3, speculative_num_draft_tokens=8)
    with opened(["req"]):
        hooks._draft(sglang, worker, "batch", 1, flag=2)
    assert sglang.calls[0][:2] == ((worker, "batch", 1), {"flag": 2}) and sglang.steps == [None]
    assert cols.asked == [("selection", 8, 3)] and seen["pushed"] == [(("req",), ("talon",), "tokens")]
    assert seen["recorded"] == [(("req",), ("talon",), "treespec_verify_tokens", "tokens")]
    assert seen["series"] == [False]


@pytest.mark.parametrize("topk, chain_active", [(4, False), (1, True)])
def test_a_policy_draft_runs_sglangs_inside_its_step(draft_round, topk, chain_active):
    cols, seen = draft_round
    cols.chain_active = chain_active
    sglang = Original()
    worker = SimpleNamespace(topk=topk, speculative_num_steps=3, speculative_num_draft_tokens=8, device="cuda:1")
    with opened(["req"]) as r:
        hooks._draft(sglang, worker, "batch", 1, flag=2)
    (step,) = sglang.steps
    assert sglang.calls[0][:2] == ((worker, "batch", 1), {"flag": 2})
    assert (step.params, step.topk, step.shares, step.token_cap) == (
        ("talon params",) if topk > 1 else cols.params, topk, (True,), 12)
    assert (step.chain is not None) == (topk == 1) and r.drafting is False and r.step is step
    assert cols.asked[0][-1] == ("cuda:1" if topk == 1 else 3) and seen["pushed"] == []  # nothing selected yet
