"""The CUDA-graph decision counter (``TREESPEC_GRAPH_LOG``): what it counts, where it writes, off by default."""

from types import SimpleNamespace

from treespec_sglang.plugin import graph_log as G


class EAGLEDraftCudaGraphRunner:  # named like SGLang's runner (the key carries the class name)
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
    assert [t for t, _, _ in registered] == list(G.RUNNERS) and all(fn is G.count_decision for _, fn, _ in registered)
    runner = EAGLEDraftCudaGraphRunner()
    for result, is_ts in ((True, True), (True, True), (False, True), (True, False)):
        ts[0] = is_ts
        assert G.count_decision(result, runner, batch("DECODE")) is result
    assert G.read_counts(str(tmp_path / "log")) == {"EAGLEDraftCudaGraphRunner|DECODE|True|ts": 2,
                                                    "EAGLEDraftCudaGraphRunner|DECODE|False|ts": 1,
                                                    "EAGLEDraftCudaGraphRunner|DECODE|True|native": 1}
