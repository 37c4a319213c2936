"""The ragged verify hook bodies as SGLang calls them: arguments passed through to the wrapped method
unchanged, which attention path a batch takes (CPU tree / chain, FlashInfer with or without a custom mask,
a batch that keeps every node), the plan the forward sees, the outputs it returns and its errors; under ``tuned``
(the CPU's ``auto``) the path each batch takes is the tuner's."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import planned
from treespec_sglang.plugin import ragged, ragged_tuner
from treespec_sglang.plugin.ragged import (amx_extend_metadata, amx_forward_metadata, eager_while_ragged,
                                           flashinfer_verify_args, plan_ragged, ragged_verify_forward)
from treespec_sglang.plugin.ragged_support import ENV_RAGGED
from treespec_sglang.plugin.ragged_tuner import ENV_TUNING


class Backend:
    def __init__(self):
        self.planned = 0
        self.forward_metadata = None

    def init_forward_metadata(self, fb):  # SGLang's CPU backend: (attn_logits, max_extend_len = N) ...
        self.planned += 1
        self.forward_metadata = ("logits", 4)
        amx_forward_metadata(None, self, fb)  # ... with the plugin's AFTER hook


class IntelAMXAttnBackend(Backend):  # named like SGLang's backends (ragged_mode reads the class names)
    pass


class FlashInferAttnBackend(Backend):
    pass


def verify_batch(backend, keep, custom_mask=True, tree_topk=4):
    bs, n = keep.shape
    spec = SimpleNamespace(custom_mask=torch.ones(bs * n * n, dtype=torch.bool) if custom_mask else None,
                           tree_topk=tree_topk)
    fb = SimpleNamespace(input_ids=torch.arange(bs * n), positions=torch.arange(bs * n) + 100,
                         out_cache_loc=torch.arange(bs * n) + 200, spec_info=spec,
                         forward_mode=SimpleNamespace(is_target_verify=lambda: True))
    return SimpleNamespace(attn_backend=backend), fb


def recording_forward(seen, hidden=True):
    """``ModelRunner.forward`` stand-in: plans a target verify's attention metadata from the live batch as SGLang's
    eager runner does (``EagerRunner._execute_extend``), records what it was called with and the plan in force;
    returns one logits row and one hidden row per token (the token's input id)."""
    def forward(runner, fb, *args, **kwargs):
        if fb.forward_mode.is_target_verify():
            runner.attn_backend.init_forward_metadata(fb)
        seen.append(dict(args=args, kwargs=kwargs, ids=fb.input_ids.tolist(), pos=fb.positions.tolist(),
                         loc=fb.out_cache_loc.tolist(), plan=ragged._plan()))
        x = fb.input_ids.float()[:, None].repeat(1, 3) + 1
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=x, hidden_states=x.clone()
                                                             if hidden else None))
    return forward


KEEP = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)  # 3 + 2 of 2 x 4 nodes
ROWS = [0, 2, 3, 4, 5]
UNIFORM = [0, 2, 3, 4, 5, 6]  # a CPU tree batch at its widest tree's width, 3: request 1 brings filler 6


@pytest.mark.parametrize("backend, env, mask, topk, want_mode, want_tree, rows, width", [
    (IntelAMXAttnBackend, "1", True, 4, "cpu", True, UNIFORM, 3),  # the compiled kernel's uniform tree extend
    (IntelAMXAttnBackend, "1", True, 1, "cpu", False, ROWS, 4),  # a chain: causal, no mask, own lengths, N
    (FlashInferAttnBackend, "1", True, 4, "flashinfer", False, ROWS, None),  # the mask is compacted in paged args
])
@pytest.mark.parametrize("hidden", [True, False])
def test_a_ragged_verify_runs_the_kept_rows_with_its_plan(monkeypatch, backend, env, mask, topk, want_mode,
                                                          want_tree, rows, width, hidden):
    monkeypatch.delenv(ENV_RAGGED, raising=False) if env is None else monkeypatch.setenv(ENV_RAGGED, env)
    runner, fb = verify_batch(backend(), KEEP, mask, topk)
    seen = []
    out, recorded = ragged_verify_forward(recording_forward(seen, hidden), runner, fb, KEEP, "a1", key="k1")
    (call,) = seen
    assert call["args"] == ("a1",) and call["kwargs"] == {"key": "k1"}
    assert call["ids"] == rows and call["pos"] == [r + 100 for r in rows] and call["loc"] == [r + 200 for r in rows]
    assert call["plan"].mode == want_mode and (call["plan"].tree_mask is not None) == want_tree
    assert runner.attn_backend.planned == 1  # once, by SGLang's eager forward, for the compacted batch
    if width is not None:  # a tree verify's max_extend_len is the plan's one width, not N
        assert runner.attn_backend.forward_metadata == ("logits", width)
        assert call["plan"].width == (width if want_tree else None)
    assert recorded == [3, 3 if rows == UNIFORM else 2] and ragged._plan() is None
    assert fb.input_ids.tolist() == list(range(8))  # restored
    want = torch.zeros(8, 3)
    want[rows] = torch.tensor(rows).float()[:, None] + 1
    lo = out.logits_output
    assert torch.equal(lo.next_token_logits, want)
    assert torch.equal(lo.hidden_states, want) if hidden else lo.hidden_states is None


@pytest.mark.parametrize("backend, env, keep, mask", [
    (IntelAMXAttnBackend, "0", KEEP, True),  # ragged verify off
    (FlashInferAttnBackend, None, KEEP, True),  # FlashInfer: opt-in only
    (FlashInferAttnBackend, "1", KEEP, False),  # a chain verify without a custom mask: nothing to compact
    (IntelAMXAttnBackend, "1", torch.ones(2, 4, dtype=torch.bool), True),  # every node kept
])
def test_padded_verify_runs_sglangs_batch_untouched(monkeypatch, backend, env, keep, mask):
    monkeypatch.delenv(ENV_RAGGED, raising=False) if env is None else monkeypatch.setenv(ENV_RAGGED, env)
    runner, fb = verify_batch(backend(), keep, mask)
    seen = []
    out, recorded = ragged_verify_forward(recording_forward(seen), runner, fb, keep, "a1", key="k1")
    (call,) = seen
    assert call["args"] == ("a1",) and call["kwargs"] == {"key": "k1"}
    assert call["ids"] == list(range(8)) and call["plan"] is None
    assert runner.attn_backend.planned == 1  # SGLang's own, for bs * N tokens (no plan of ours in force)
    assert recorded == [4, 4]
    assert out.logits_output.next_token_logits[:, 0].tolist() == [i + 1.0 for i in range(8)]


def test_hooks_pass_their_arguments_through_outside_a_ragged_verify():
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "sglang's"

    verify = SimpleNamespace(is_target_verify=lambda: True)
    fb = SimpleNamespace(forward_mode=verify)
    assert amx_extend_metadata(original, "backend", fb, 1, k=2) == "sglang's"
    assert flashinfer_verify_args(original, "spec", 1, k=2) == "sglang's"
    assert eager_while_ragged(original, "runner", fb, 1, k=2) == "sglang's"
    assert calls == [(("backend", fb, 1), {"k": 2}), (("spec", 1), {"k": 2}), (("runner", fb, 1), {"k": 2})]
    with planned(plan_ragged(KEEP, None)):  # during a ragged verify, the metadata of a non-verify forward (a draft extend) is SGLang's
        other = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: False))
        assert amx_extend_metadata(original, "backend", other, 3, k=4) == "sglang's"
    assert calls[-1] == (("backend", other, 3), {"k": 4})


def test_amx_metadata_of_a_ragged_verify_and_its_token_check():
    plan = plan_ragged(KEEP, torch.ones(32, dtype=torch.bool))
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True), input_ids=torch.arange(5),
                         seq_lens=torch.tensor([10, 20]))
    with planned(plan):
        seq, ext, start, mask = amx_extend_metadata(None, "backend", fb)
        assert seq.tolist() == [13, 22] and ext.tolist() == [3, 2] and start.tolist() == [0, 3]
        assert ext.dtype == start.dtype == torch.int32 and mask is plan.tree_mask
        fb.input_ids = torch.arange(7)
        with pytest.raises(RuntimeError, match=r"ragged verify: 7 tokens in the forward, 5 planned"):
            amx_extend_metadata(None, "backend", fb)


def test_plan_defaults_to_the_cpu_path_and_refuses_misshaped_rows():
    plan = plan_ragged(KEEP, None)
    assert plan.mode == "cpu" and plan.keep is KEEP and plan.n == 4 and plan.total == 5
    one = torch.zeros(2, dtype=torch.long)
    msg = r"^rows must be \[T\]; lens and starts \[bs\]$"
    for rows, lens, starts in [(one[None], one, one), (one, one[None], one[None]), (one, one, one[:1])]:
        with pytest.raises(ValueError, match=msg):
            ragged.RaggedVerify(rows, lens, starts, None, 4)


def test_compacted_paged_args_are_int32_like_sglangs():
    kv_indptr = torch.tensor([0, 6, 11], dtype=torch.int32)  # prefixes 2 and 1, N 4
    kv_indices = torch.arange(11, dtype=torch.int32)
    mask = torch.ones(4 * 11, dtype=torch.bool)
    kv, kv_ptr, qo_ptr, m = ragged.compact_paged_verify_args(kv_indices, kv_indptr, mask, KEEP)
    assert kv.dtype == kv_ptr.dtype == qo_ptr.dtype == torch.int32 and m.dtype == torch.bool
    assert kv_ptr.tolist() == [0, 5, 8] and qo_ptr.tolist() == [0, 3, 5]
    assert kv.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]


def test_spec_and_logits_without_the_optional_attributes(monkeypatch):
    """SGLang objects that lack the attribute altogether: a chain verify input without ``custom_mask`` under
    FlashInfer runs padded; a logits output without ``hidden_states`` comes back without it."""
    monkeypatch.setenv(ENV_RAGGED, "1")
    runner, fb = verify_batch(FlashInferAttnBackend(), KEEP)
    fb.spec_info = SimpleNamespace(tree_topk=1)
    seen = []
    _, recorded = ragged_verify_forward(recording_forward(seen), runner, fb, KEEP)
    assert seen[0]["plan"] is None and recorded == [4, 4]

    def no_hidden(runner, fb):
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=fb.input_ids.float()[:, None]))
    monkeypatch.setenv(ENV_RAGGED, "1")
    runner, fb = verify_batch(IntelAMXAttnBackend(), KEEP)
    lo = ragged_verify_forward(no_hidden, runner, fb, KEEP)[0].logits_output
    assert not hasattr(lo, "hidden_states") and lo.next_token_logits[ROWS, 0].tolist() == [float(r) for r in ROWS]


# ---------------------------------------------------------------- the tuner (TREESPEC_RAGGED_VERIFY=tuned / auto)
@pytest.mark.parametrize("setting", ["tuned", "auto", None])
def test_the_verify_hook_runs_each_batch_the_tuned_way(monkeypatch, setting):
    """``tuned`` on SGLang's CPU backend, and ``auto`` (or unset) there too: the tuner's warm-up alternates the
    plain forward (every node) and the compacted one; the tree sizes recorded follow the path taken."""
    monkeypatch.delenv(ENV_RAGGED, raising=False) if setting is None else monkeypatch.setenv(ENV_RAGGED, setting)
    monkeypatch.setenv(ENV_TUNING, "warmup=2")
    monkeypatch.setattr(ragged, "verify_group", lambda: None)
    paths, recorded = [], []
    for _ in range(4):
        runner, fb = verify_batch(IntelAMXAttnBackend(), KEEP)
        seen = []
        _, sizes = ragged_verify_forward(recording_forward(seen), runner, fb, KEEP)
        paths.append(seen[0]["plan"] is not None)
        recorded.append(sizes)
    assert paths == [False, True, False, True]
    assert recorded == [[4, 4], [3, 3], [4, 4], [3, 3]]  # a CPU tree batch runs at its widest kept tree
    t = ragged_tuner._TUNER[0]
    assert t.options.warmup == 2 and t.table()["2-3, N 4"]["samples"] == [2, 2]


@pytest.mark.parametrize("setting, backend, ragged_run", [
    ("1", IntelAMXAttnBackend, True), ("1", FlashInferAttnBackend, True),  # every compactable verify ragged
    ("0", IntelAMXAttnBackend, False), ("auto", FlashInferAttnBackend, False),  # padded, SGLang's own
])
def test_other_settings_never_make_a_tuner(monkeypatch, setting, backend, ragged_run):
    monkeypatch.setenv(ENV_RAGGED, setting)
    for _ in range(3):
        runner, fb = verify_batch(backend(), KEEP)
        seen = []
        ragged_verify_forward(recording_forward(seen), runner, fb, KEEP)
        assert (seen[0]["plan"] is not None) == ragged_run
    assert ragged_tuner._TUNER[0] is None


@pytest.mark.parametrize("keep, reads, want", [(KEEP, 1, [3, 3]), (torch.ones(2, 4, dtype=torch.bool), 1, [4, 4])])
def test_a_ragged_verify_reads_the_host_once(monkeypatch, keep, reads, want):
    """The kept sizes, read once, give the plan's shape and the verify-token stats (no second read after the
    forward); a batch that keeps every node runs padded after that one read."""
    from treespec_sglang.utils.syncs import count_ops

    def forward(runner, fb):  # reads nothing on the host
        x = fb.input_ids.float()[:, None]
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=x, hidden_states=None))

    monkeypatch.setenv(ENV_RAGGED, "1")  # every verify ragged (``auto`` on the CPU: the tuner's first turn is padded)
    runner, fb = verify_batch(IntelAMXAttnBackend(), keep)
    with count_ops() as c:
        _, sizes = ragged_verify_forward(forward, runner, fb, keep)
    assert sizes == want and c.reads == reads


def test_a_chosen_ragged_verify_with_nothing_to_compact_is_no_sample(monkeypatch):
    monkeypatch.setenv(ENV_RAGGED, "tuned")
    monkeypatch.setenv(ENV_TUNING, "warmup=2")
    monkeypatch.setattr(ragged, "verify_group", lambda: None)
    full = torch.ones(2, 4, dtype=torch.bool)
    # padded; a ragged turn with nothing to compact (ran padded: no sample) passed on; ragged; padded
    for keep in (KEEP, full, KEEP, full):
        runner, fb = verify_batch(IntelAMXAttnBackend(), keep)
        ragged_verify_forward(recording_forward([]), runner, fb, keep)
    assert ragged_tuner._TUNER[0].table()["2-3, N 4"]["samples"] == [2, 1]


# ---------------------------------------------------------------- FlashInfer's paged arguments, the round, the tuner
PADDED_KV_INDPTR = torch.tensor([0, 6, 11], dtype=torch.int32)  # KEEP's batch at prefixes 2 and 1, N 4


def paged_args():
    """SGLang's padded FlashInfer verify arguments for KEEP's batch (prefixes 2 and 1)."""
    return (torch.arange(11, dtype=torch.int32) + 50, PADDED_KV_INDPTR, torch.arange(3, dtype=torch.int32) * 4,
            torch.arange(44) % 3 != 0)


@pytest.mark.parametrize("seq_lens_cpu, reads", [(torch.tensor([2, 1, 7]), 0), (None, 1)])
def test_a_flashinfer_ragged_verify_sizes_its_arguments_from_the_hosts_prefixes(monkeypatch, seq_lens_cpu, reads):
    """SGLang's eager FlashInfer plan builds the paged arguments inside the forward; compacted there from the batch's
    ``seq_lens_cpu`` (its first bs of a longer buffer) they need no host read (without it: one, of ``kv_indptr``)
    and equal the compaction that reads ``kv_indptr``."""
    from treespec_sglang.utils.syncs import count_ops

    monkeypatch.setenv(ENV_RAGGED, "1")
    runner, fb = verify_batch(FlashInferAttnBackend(), KEEP)
    if seq_lens_cpu is not None:
        fb.seq_lens_cpu = seq_lens_cpu
    padded, seen = paged_args(), []

    def forward(runner, fb):
        with count_ops() as c:
            seen.append(flashinfer_verify_args(lambda spec, **kw: padded, fb.spec_info, req_pool_indices=None,
                                               paged_kernel_lens=None, paged_kernel_lens_sum=3))
        seen.append(c.reads)
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=torch.zeros(5, 1), hidden_states=None))

    ragged_verify_forward(forward, runner, fb, KEEP)
    got, n_reads = seen
    want = ragged.compact_paged_verify_args(padded[0], padded[1], padded[3], KEEP)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and n_reads == reads
    assert got[1].tolist() == [0, 5, 8] and got[2].tolist() == [0, 3, 5]


def test_host_prefixes_that_disagree_with_sglangs_sum_are_refused(monkeypatch):
    monkeypatch.setenv(ENV_RAGGED, "1")
    runner, fb = verify_batch(FlashInferAttnBackend(), KEEP)
    fb.seq_lens_cpu = torch.tensor([2, 2])

    def forward(runner, fb):
        return flashinfer_verify_args(lambda spec, **kw: paged_args(), fb.spec_info, paged_kernel_lens_sum=3)

    with pytest.raises(RuntimeError, match=r"^ragged verify: the batch's seq_lens_cpu sum to 4, SGLang's "
                                           r"paged_kernel_lens_sum is 3$"):
        ragged_verify_forward(forward, runner, fb, KEEP)


def test_a_ragged_verify_plans_in_the_round_it_runs_in(monkeypatch):
    """Inside a plugin round the plan is that round's while the forward runs and gone after it (no round of its own
    in between, which the round's other hooks would not see); called alone it opens one for the forward."""
    from treespec_sglang.plugin.round import current, opened

    monkeypatch.setenv(ENV_RAGGED, "1")
    during = []

    def forward(runner, fb):
        during.append((current(), current().plan))
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=torch.zeros(6, 1), hidden_states=None))

    with opened() as outer:
        runner, fb = verify_batch(IntelAMXAttnBackend(), KEEP)
        ragged_verify_forward(forward, runner, fb, KEEP)
        assert during[0][0] is outer and during[0][1].rows.tolist() == UNIFORM and outer.plan is None
    runner, fb = verify_batch(IntelAMXAttnBackend(), KEEP)
    ragged_verify_forward(forward, runner, fb, KEEP)
    assert during[1][0] is not None and during[1][0] is not outer and during[1][1].rows.tolist() == UNIFORM
    assert current() is None


class FakeTuner:
    """The tuner's face to the verify hook: what it was asked, and the path it answers."""

    def __init__(self, ragged_run):
        self.ragged_run, self.calls, self.samples = ragged_run, [], []
        self.buckets = {ragged_tuner.bucket(2, 4): "bucket 2-3, N 4"}

    def choose(self, bs, n, group):
        self.calls.append(("choose", bs, n, group))
        return self.ragged_run

    def proposal(self, b):
        self.calls.append(("proposal", b))
        return not self.ragged_run  # this rank's own proposal, outvoted

    @contextlib.contextmanager
    def timed(self, bs, n, ragged_run, device):
        sample = SimpleNamespace(kept=True)
        self.calls.append(("timed", bs, n, ragged_run, device))
        yield sample
        self.samples.append(sample.kept)


@pytest.mark.parametrize("ragged_run, keep, sample", [(True, KEEP, True), (False, KEEP, True),
                                                      (True, torch.ones(2, 4, dtype=torch.bool), False)])
@pytest.mark.parametrize("digests", [False, True])
def test_a_tuned_verify_asks_the_tuner_for_the_verify_group_and_runs_its_answer(monkeypatch, ragged_run, keep,
                                                                                 sample, digests):
    """Under ``tuned`` the hook asks the process's tuner (a rank's test fault passed as ``contrary``) for the path of
    this batch's bucket in the verify group, times the forward there with SGLang's arguments passed through, and
    (debug digests on) records its own proposal beside the path every rank runs; a ragged turn with nothing to
    compact is no sample."""
    monkeypatch.setenv(ENV_RAGGED, "tuned")
    group, fake, made, recorded = object(), FakeTuner(ragged_run), [], []
    monkeypatch.setattr(ragged, "verify_group", lambda: group)
    monkeypatch.setattr(ragged, "perturbed_rank", lambda g: "fault" if g is group else None)
    monkeypatch.setattr(ragged, "tuner", lambda contrary: made.append(contrary) or fake)
    monkeypatch.setattr(ragged, "digests_dir", lambda: "/digests" if digests else None)
    monkeypatch.setattr(ragged, "record_digest", lambda *a: recorded.append(a))
    runner, fb = verify_batch(IntelAMXAttnBackend(), keep)
    seen = []
    _, sizes = ragged_verify_forward(recording_forward(seen), runner, fb, keep, "a1", key="k1")
    (call,) = seen
    assert call["args"] == ("a1",) and call["kwargs"] == {"key": "k1"}
    assert (call["plan"] is not None) == (ragged_run and sample)
    assert sizes == ([3, 3] if ragged_run and sample else [4, 4])
    assert made == ["fault"] and fake.calls[0] == ("choose", 2, 4, group)
    assert fake.calls[-1] == ("timed", 2, 4, ragged_run, keep.device) and fake.samples == [sample]
    if digests:
        assert fake.calls[1] == ("proposal", "bucket 2-3, N 4")
        ((mine, ran, g, prefix),) = recorded
        assert [t.tolist() for t in mine] == [[not ragged_run]] and [t.tolist() for t in ran] == [[ragged_run]]
        assert g is group and prefix == "ragged-"
    else:
        assert recorded == [] and len(fake.calls) == 2
