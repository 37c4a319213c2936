"""The CUDA-graph decision counter (``TREESPEC_GRAPH_LOG``): what it counts, where it writes, off by default."""

from types import SimpleNamespace

from treespec_sglang.plugin import graph_log as G


class EAGLEDraftCudaGraphRunner:  # named like SGLang's runners (the key carries the class name)
    pass


class DecodeCudaGraphRunner:
    pass


def batch(mode):
    return SimpleNamespace(forward_mode=SimpleNamespace(name=mode))


def test_off_by_default_the_result_passes_and_nothing_is_written(monkeypatch, tmp_path):
    monkeypatch.delenv(G.ENV_GRAPH_LOG, raising=False)
    assert G.count_decision("R", EAGLEDraftCudaGraphRunner(), batch("DECODE")) == "R"
    registered = []
    assert not G.register_counting(SimpleNamespace(register=lambda *a: registered.append(a)), "AFTER", lambda: True)
    assert registered == [] and list(tmp_path.iterdir()) == []


def test_decisions_are_counted_by_runner_mode_result_and_round_kind(monkeypatch, tmp_path):
    monkeypatch.setenv(G.ENV_GRAPH_LOG, str(tmp_path / "log"))
    monkeypatch.setattr(G, "_COUNTS", G.Counter())
    registered, ts = [], [True]
    registry = SimpleNamespace(register=lambda target, fn, kind: registered.append((target, fn, kind)))
    assert G.register_counting(registry, "AFTER", lambda: ts[0])
    assert [t for t, _, _ in registered] == list(G.RUNNERS)
    bodies = {t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1]: fn for t, fn, _ in registered}
    assert bodies == {"DecodeCudaGraphRunner.can_run_graph": G.count_decision,
                      "EAGLEDraftExtendCudaGraphRunner.can_run_graph": G.count_decision,
                      "EAGLEDraftCudaGraphRunner.execute": G.count_draft_replay,
                      "EagleDraftWorker.draft_forward": G.count_draft_eager}
    runner = DecodeCudaGraphRunner()
    for result, is_ts in ((True, True), (True, True), (False, True), (True, False)):
        ts[0] = is_ts
        assert G.count_decision(result, runner, batch("TARGET_VERIFY")) is result
    assert G.read_counts(str(tmp_path / "log")) == {"DecodeCudaGraphRunner|TARGET_VERIFY|True|ts": 2,
                                                    "DecodeCudaGraphRunner|TARGET_VERIFY|False|ts": 1,
                                                    "DecodeCudaGraphRunner|TARGET_VERIFY|True|native": 1}


def test_the_draft_counts_how_it_ran_not_what_can_run_graph_said(monkeypatch, tmp_path):
    """A replay of the draft graph counts True, the eager loop of a round False, under the draft graph runner's name,
    whatever ``can_run_graph`` answered before the plugin (a C2T chain round) or SGLang (a DSA target) drafted
    eagerly; the loop SGLang runs to capture its graph (outside any round) is not counted."""
    monkeypatch.setenv(G.ENV_GRAPH_LOG, str(tmp_path))
    monkeypatch.setattr(G, "_COUNTS", G.Counter())
    monkeypatch.setitem(G._LABEL, "treespec_round", lambda: True)
    assert G.count_draft_replay("out", EAGLEDraftCudaGraphRunner(), batch("DECODE")) == "out"
    worker, in_round = SimpleNamespace(), [False]
    monkeypatch.setitem(G._LABEL, "in_round", lambda: in_round[0])
    assert G.count_draft_eager("out", worker, batch("DECODE")) == "out"  # SGLang capturing its draft graph
    assert G._COUNTS == {"EAGLEDraftCudaGraphRunner|DECODE|True|ts": 1}
    in_round[0] = True
    assert G.count_draft_eager("out", worker, batch("DECODE")) == "out"
    assert G.count_draft_eager("out", worker, forward_batch=batch("DECODE")) == "out"
    assert G._COUNTS == {"EAGLEDraftCudaGraphRunner|DECODE|True|ts": 1, "EAGLEDraftCudaGraphRunner|DECODE|False|ts": 2}
    assert set(G.read_counts(str(tmp_path))) == set(G._COUNTS)  # each key written when it first appears


def test_a_batch_without_a_forward_mode_counts_under_a_question_mark(monkeypatch, tmp_path):
    monkeypatch.setenv(G.ENV_GRAPH_LOG, str(tmp_path))
    monkeypatch.setattr(G, "_COUNTS", G.Counter())
    monkeypatch.setitem(G._LABEL, "treespec_round", None)  # no round label registered: native
    G.count_decision(True, DecodeCudaGraphRunner(), None)
    G.count_decision(False, DecodeCudaGraphRunner(), SimpleNamespace())
    G.count_decision(True, DecodeCudaGraphRunner(), SimpleNamespace(forward_mode=object()))
    assert G._COUNTS == {"DecodeCudaGraphRunner|?|True|native": 2, "DecodeCudaGraphRunner|?|False|native": 1}


def test_the_file_is_rewritten_when_a_key_appears_and_every_50th_count(monkeypatch, tmp_path):
    """Not on every count (a file write per forward): a known key's counts reach the file at each 50th count of
    the process, so what a reader sees lags by fewer than 50."""
    monkeypatch.setenv(G.ENV_GRAPH_LOG, str(tmp_path))
    monkeypatch.setattr(G, "_COUNTS", G.Counter())
    monkeypatch.setitem(G._LABEL, "treespec_round", lambda: True)
    key = "DecodeCudaGraphRunner|DECODE|True|ts"
    seen = []
    for _ in range(101):
        G.count_decision(True, DecodeCudaGraphRunner(), batch("DECODE"))
        seen.append(G.read_counts(str(tmp_path))[key])
    assert seen[0] == 1 and seen[1] == 1 and seen[48] == 1  # written once, when the key appeared
    assert seen[49] == 50 and seen[98] == 50 and seen[99] == 100 and seen[100] == 100


def test_registering_twice_into_an_existing_directory_keeps_the_labels_and_the_hook_type(monkeypatch, tmp_path):
    monkeypatch.setenv(G.ENV_GRAPH_LOG, str(tmp_path))  # exists already (a restarted scheduler, a second one)
    monkeypatch.setattr(G, "_COUNTS", G.Counter())
    monkeypatch.setattr(G, "_LABEL", {"treespec_round": None, "in_round": None})
    kinds = []
    registry = SimpleNamespace(register=lambda target, fn, kind: kinds.append(kind))
    in_round = [False]
    for _ in range(2):
        assert G.register_counting(registry, "AFTER", lambda: False, in_round=lambda: in_round[0])
    assert kinds == ["AFTER"] * (2 * len(G.RUNNERS))
    G.count_draft_eager("out", SimpleNamespace(), batch("DECODE"))  # outside a round (graph capture): not counted
    assert G._COUNTS == {}
    in_round[0] = True
    G.count_draft_eager("out", SimpleNamespace(), batch("DECODE"))
    assert G._COUNTS == {"EAGLEDraftCudaGraphRunner|DECODE|False|native": 1}
