import pytest


@pytest.fixture
def series(monkeypatch):
    """Fresh Prometheus series on a private registry, installed as this process's scheduler series:
    ``(SchedulerSeries, CollectorRegistry)``."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from treespec_sglang.plugin import metrics

    reg = prometheus_client.CollectorRegistry()
    for cls in ("Counter", "Histogram"):
        real = getattr(prometheus_client, cls)
        monkeypatch.setattr(prometheus_client, cls, lambda *a, _r=real, **k: _r(*a, registry=reg, **k))
    s = metrics.SchedulerSeries({"model_name": "m", "tp_rank": 0})
    monkeypatch.setattr(metrics, "_scheduler", s)
    return s, reg
