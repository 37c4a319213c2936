"""The round profiler (``TREESPEC_PROFILE``): exclusive parts that add up to the round, round kinds, op counts
that leave SGLang's calls out, and the per-process files summed."""

import json

import pytest
import torch

from treespec_sglang.plugin import profile as P


class Ticks:
    """A clock that advances only when told (``advance``), so every expected time is exact."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


def make_round(profile, clock, treespec: bool):
    """A fake round: the round hook (AROUND on ``P.ROUND``) around SGLang's round, which calls an AROUND-hooked
    SGLang function (the draft) and an AFTER hook; each piece advances the clock by a known amount."""
    def draft_sglang(x):
        clock.advance(7)  # SGLang's draft
        return x + 1

    def draft_hook(original, x):
        clock.advance(2)  # the plugin's part of the draft hook
        return original(x)

    def after_hook(result, x):
        clock.advance(1)
        return result

    draft = P.profiled(profile, "sglang.srt.x.Worker.draft", "AROUND", draft_hook, lambda: treespec)
    after = P.profiled(profile, "sglang.srt.x.after", "AFTER", after_hook, lambda: treespec)

    def round_sglang(x):
        clock.advance(10)  # the rest of SGLang's round
        y = draft(draft_sglang, x)
        return after(y, x)

    def round_hook(original, x):
        clock.advance(3)
        return original(x)

    return lambda x: P.profiled(profile, P.ROUND, "AROUND", round_hook, lambda: treespec)(round_sglang, x)


@pytest.mark.parametrize("treespec", [True, False])
def test_parts_are_exclusive_and_add_up_to_the_round(treespec):
    clock = Ticks()
    prof = P.Profile(None, clock=clock)
    run = make_round(prof, clock, treespec)
    assert run(1) == 2 and run(5) == 6
    kind = "ts" if treespec else "native"
    tot = prof.totals[kind]
    assert set(prof.totals) == {kind} and tot["rounds"] == 2 and tot["round_s"] == 2 * 23
    parts = {k: v for k, v in tot["parts"].items()}
    assert parts == {"hook:round_hook": [6, 2], "sglang:EAGLEWorkerV2.forward_batch_generation": [20, 2],
                     "hook:draft_hook": [4, 2], "sglang:Worker.draft": [14, 2], "hook:after_hook": [2, 2]}
    assert sum(s for s, _ in parts.values()) == tot["round_s"]


class Mode:
    def __init__(self, name):
        self.name = name

    def is_extend(self):
        return self.name == "EXTEND"

    def is_idle(self):
        return self.name == "IDLE"


@pytest.mark.parametrize("mode,extend_in_batch,kind", [("DECODE", False, "ts"), ("EXTEND", False, "prefill"),
                                                       ("DECODE", True, "prefill"), ("IDLE", False, "idle")])
def test_a_prefill_or_idle_call_is_not_a_decode_round(mode, extend_in_batch, kind):
    from types import SimpleNamespace

    clock = Ticks()
    prof = P.Profile(None, clock=clock)
    batch = SimpleNamespace(forward_mode=Mode(mode), is_extend_in_batch=extend_in_batch)
    worker = object()
    run = P.profiled(prof, P.ROUND, "AROUND", lambda original, self, b: original(self, b), lambda: True)
    run(lambda self, b: clock.advance(4), worker, batch)
    assert set(prof.totals) == {kind} and prof.totals[kind]["round_s"] == 4


def test_hooks_between_rounds_go_to_the_next_round():
    clock = Ticks()
    prof = P.Profile(None, clock=clock)
    arrival = P.profiled(prof, "sglang.srt.x.arrive", "AFTER", lambda r: clock.advance(4), lambda: False)
    arrival(None)
    make_round(prof, clock, True)(0)
    assert prof.totals["ts"]["parts"]["hook:<lambda>"] == [4, 1] and not prof.pending


def test_ops_are_counted_in_hooks_only():
    prof = P.Profile(None, count=True)
    x = torch.arange(6.0)

    def sglang_fn(t):
        return (t * 2).sum() + t.max()  # 3 ops, SGLang's: not the plugin's

    def hook(original, t):
        y = (t + 1).exp()  # 2 ops
        _ = y.sum().item()  # 2 ops, one host read
        return original(t)

    wrapped = P.profiled(prof, "sglang.srt.x.f", "AROUND", hook, lambda: True)
    wrapped(sglang_fn, x)
    assert dict(prof.pending_ops) == {"hook:hook": [4, 1]}
    prof.end_round("ts", 0.0)
    assert prof.totals["ts"]["ops"] == {"hook:hook": [4, 1]}


def test_files_per_process_are_summed(tmp_path):
    prof = P.Profile(str(tmp_path), clock=Ticks())
    prof.pending["hook:a"] = [0.5, 1]
    prof.end_round("ts", 1.0)
    written = json.loads(next(tmp_path.glob("profile-*.json")).read_text())
    assert written["ts"]["parts"] == {"hook:a": [0.5, 1]}
    (tmp_path / "profile-1.json").write_text(json.dumps(
        {"ts": {"rounds": 2, "round_s": 3.0, "parts": {"hook:a": [1.0, 2], "hook:b": [2.0, 2]}, "ops": {}},
         "native": {"rounds": 1, "round_s": 0.5, "parts": {}, "ops": {}}}))
    got = P.read_profile(str(tmp_path))
    assert got["ts"]["rounds"] == 3 and got["ts"]["round_s"] == 4.0
    assert got["ts"]["parts"] == {"hook:a": [1.5, 3], "hook:b": [2.0, 2]} and got["native"]["rounds"] == 1


@pytest.mark.parametrize("env,expect", [({}, None), ({"TREESPEC_PROFILE": "d"}, (False, False)),
                                        ({"TREESPEC_PROFILE": "d", "TREESPEC_PROFILE_OPS": "1",
                                          "TREESPEC_PROFILE_SYNC": "1"}, (True, True)),
                                        ({"TREESPEC_PROFILE": "d", "TREESPEC_PROFILE_OPS": "0"}, (False, False)),
                                        ({"TREESPEC_PROFILE": "d", "TREESPEC_PROFILE_OPS": "false",
                                          "TREESPEC_PROFILE_SYNC": " On"}, (False, True))])
def test_profile_from_env(monkeypatch, tmp_path, env, expect):
    for k in (P.ENV_PROFILE, P.ENV_PROFILE_OPS, P.ENV_PROFILE_SYNC):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, str(tmp_path / v) if k == P.ENV_PROFILE else v)
    prof = P.profile_from_env()
    if expect is None:
        assert prof is None
    else:
        assert (prof.count, prof.sync) == expect and (tmp_path / "d").is_dir() and prof.out_dir == str(tmp_path / "d")


@pytest.mark.parametrize("profiling", [False, True])
def test_register_hooks_times_every_body_only_when_asked(hook_registry, monkeypatch, tmp_path, profiling):
    from treespec_sglang.plugin import hooks

    got = hook_registry
    if profiling:
        monkeypatch.setenv(P.ENV_PROFILE, str(tmp_path))
    hooks.register_hooks()
    assert [(t, k) for t, _, k in got] == [(h.target, h.kind) for h in hooks.HOOKS_IN_ORDER]
    for (_, body, _), h in zip(got, hooks.HOOKS_IN_ORDER):
        assert (body is not h.body and body.__wrapped__ is h.body) if profiling else body is h.body


def test_sglangs_own_host_reads_inside_a_counted_hook_are_not_the_hooks():
    prof = P.Profile(None, count=True)
    x = torch.arange(4.0)

    def sglang_round(t):
        _ = t.tolist()  # SGLang's own host reads
        _ = (t * 2).numpy()
        return nested(lambda u: u, t)

    def nested_hook(original, t):
        _ = (t + 1).tolist()  # the nested hook's: 1 op, 1 read
        return original(t)

    nested = P.profiled(prof, "sglang.srt.x.g", "AROUND", nested_hook, lambda: True)
    outer = P.profiled(prof, P.ROUND, "AROUND", lambda original, t: original(t), lambda: True)
    outer(sglang_round, x)
    assert prof.totals["ts"]["ops"] == {"hook:<lambda>": [0, 0], "hook:nested_hook": [1, 1]}
    assert torch.Tensor.tolist is P._ORIGINAL_READS["tolist"]  # every patch undone


def test_a_bad_profile_switch_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(P.ENV_PROFILE, str(tmp_path / "d"))
    monkeypatch.setenv(P.ENV_PROFILE_OPS, "2")
    with pytest.raises(ValueError, match="TREESPEC_PROFILE_OPS must be one of 1 / 0"):
        P.profile_from_env()


def test_by_default_a_profile_neither_counts_ops_nor_syncs(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(1))
    prof = P.Profile(None)
    hook = P.profiled(prof, "sglang.srt.x.f", "AFTER", lambda result: (torch.arange(3.0) + 1).sum(), lambda: True)
    hook(None)
    prof.end_round("ts", 0.0)
    assert (prof.count, prof.sync) == (False, False) and synced == []
    assert prof.totals["ts"]["ops"] == {} and prof.totals["ts"]["parts"]["hook:<lambda>"][1] == 1


@pytest.mark.parametrize("available, initialized, capturing, synced", [
    (True, True, False, True),  # a live CUDA context outside a capture: every boundary synchronises
    (True, False, False, False),  # CUDA present but never initialised in this process (a CPU server on a GPU node)
    (False, True, False, False),
    (True, True, True, False),  # inside a CUDA-graph capture a sync is illegal
])
def test_sync_mode_synchronises_only_a_live_device_outside_a_capture(monkeypatch, available, initialized,
                                                                     capturing, synced):
    from treespec_sglang.plugin import draft_select

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append(1))
    monkeypatch.setattr(draft_select, "capturing", lambda: capturing)
    clock = Ticks()
    prof = P.Profile(None, sync=True, clock=clock)
    assert prof._now() == 0.0
    assert calls == ([1] if synced else [])


def test_op_counts_add_up_over_rounds():
    prof = P.Profile(None, count=True)

    def hook(result, t):
        _ = (t + 1).tolist()  # 1 op, 1 host read
        return result

    wrapped = P.profiled(prof, "sglang.srt.x.f", "AFTER", hook, lambda: True)
    for rounds in (1, 2):
        wrapped(None, torch.arange(3.0))
        prof.end_round("ts", 0.0)
        assert prof.totals["ts"]["ops"] == {"hook:hook": [rounds, rounds]}


def test_an_unwritable_profile_directory_is_logged_and_the_round_goes_on(tmp_path, caplog):
    gone = tmp_path / "missing"
    prof = P.Profile(str(gone), clock=Ticks())
    prof.pending["hook:a"] = [0.5, 1]
    with caplog.at_level("WARNING", logger="treespec_sglang.plugin"):
        totals = prof.end_round("ts", 1.0)
    assert totals["ts"]["parts"] == {"hook:a": [0.5, 1]}
    (record,) = caplog.records
    assert record.getMessage().startswith(f"treespec profile: cannot write {gone}/profile-")
    assert "No such file or directory" in record.getMessage()


def test_a_body_without_a_name_is_timed_as_hook_and_keyword_arguments_reach_sglang():
    import functools
    from types import SimpleNamespace

    clock = Ticks()
    prof = P.Profile(None, clock=clock)

    def after(result, x, scale=1):
        return result

    unnamed = P.profiled(prof, "sglang.srt.x.after", "AFTER", functools.partial(after, scale=2), lambda: False)
    unnamed(None, 1)
    seen = []

    def sglang_round(worker, batch=None):  # SGLang's round called with its batch by keyword
        seen.append(batch)
        clock.advance(5)

    batch = SimpleNamespace(forward_mode=Mode("DECODE"))  # no is_extend_in_batch: a decode round
    run = P.profiled(prof, P.ROUND, "AROUND", lambda original, w, batch=None: original(w, batch=batch), lambda: True)
    run(sglang_round, object(), batch=batch)
    assert seen == [batch] and set(prof.totals) == {"ts"} and prof.totals["ts"]["round_s"] == 5
    assert prof.totals["ts"]["parts"]["hook:hook"] == [0, 1]


def test_read_profile_sums_op_counts_and_reads_files_without_them(tmp_path):
    (tmp_path / "profile-1.json").write_text(json.dumps(
        {"ts": {"rounds": 1, "round_s": 1.0, "parts": {"hook:a": [1.0, 1]}, "ops": {"hook:a": [5, 1]}}}))
    (tmp_path / "profile-2.json").write_text(json.dumps(
        {"ts": {"rounds": 2, "round_s": 2.0, "parts": {"hook:a": [1.0, 2]}, "ops": {"hook:a": [7, 0]}}}))
    (tmp_path / "profile-3.json").write_text(json.dumps(  # written without op counts (no "ops" key)
        {"ts": {"rounds": 1, "round_s": 0.5, "parts": {"hook:a": [0.5, 1]}}}))
    got = P.read_profile(str(tmp_path))["ts"]
    assert got == {"rounds": 4, "round_s": 3.5, "parts": {"hook:a": [2.5, 4]}, "ops": {"hook:a": [12, 1]}}
