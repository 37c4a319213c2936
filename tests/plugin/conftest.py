import pytest


@pytest.fixture
def private_registry(monkeypatch):
    """A fresh ``CollectorRegistry`` that every ``prometheus_client.Counter`` / ``Histogram`` made during the test
    registers in (not the process's default registry)."""
    prometheus_client = pytest.importorskip("prometheus_client")
    reg = prometheus_client.CollectorRegistry()
    for cls in ("Counter", "Histogram"):
        real = getattr(prometheus_client, cls)
        monkeypatch.setattr(prometheus_client, cls, lambda *a, _r=real, **k: _r(*a, registry=reg, **k))
    return reg


@pytest.fixture
def series(monkeypatch, private_registry):
    """Fresh Prometheus series on a private registry, installed as this process's scheduler series:
    ``(SchedulerSeries, CollectorRegistry)``."""
    from treespec_sglang.plugin import metrics

    s = metrics.SchedulerSeries({"model_name": "m", "tp_rank": 0})
    monkeypatch.setattr(metrics, "_scheduler", s)
    return s, private_registry


@pytest.fixture(scope="module")
def loaded():
    """(sglang tests) sglang's own loader: discovers our entry point and applies every hook."""
    import logging

    import torch
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


@pytest.fixture
def fresh_registry():
    """The policy registry (process-wide) as it was before the test: a policy the test registers is removed again
    after it. Yields the registry module."""
    from treespec_sglang.policies import registry

    before = dict(registry.REGISTRY)
    yield registry
    for name in set(registry.REGISTRY) - set(before):
        registry.POLICIES.pop(name)
        registry._BY_PARAMS.pop(registry.REGISTRY.pop(name).Params)


@pytest.fixture
def custom(fresh_registry):
    """``tests/e2e/custom_policy.py``'s policies (``root-children``: a custom pool rule; ``engine-only``: none),
    registered for one test, then removed again (the registry is process-wide). Yields the module."""
    import importlib
    import sys

    yield importlib.import_module("tests.e2e.custom_policy")
    sys.modules.pop("tests.e2e.custom_policy", None)



@pytest.fixture
def hook_registry(monkeypatch):
    """A stand-in for SGLang's ``hook_registry`` module that ``register_hooks`` imports: yields the registrations in
    order, ``(target, body, kind)``. The graph log's labels are put back after the test, and ``TREESPEC_GRAPH_LOG`` /
    ``TREESPEC_PROFILE`` start unset."""
    import sys
    import types

    from treespec_sglang.plugin import graph_log

    got = []
    fake = types.ModuleType("sglang.srt.plugins.hook_registry")
    fake.HookType = types.SimpleNamespace(BEFORE="BEFORE", AFTER="AFTER", AROUND="AROUND")
    fake.HookRegistry = types.SimpleNamespace(register=lambda target, body, kind: got.append((target, body, kind)))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", fake)
    monkeypatch.setattr(graph_log, "_LABEL", dict(graph_log._LABEL))
    for var in ("TREESPEC_GRAPH_LOG", "TREESPEC_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    return got
