"""dtype resolution: names, errors, and the auto fallback on a CPU without native bf16."""

import pytest
import torch

import treespec_sglang.engine.dtypes as D


@pytest.mark.parametrize("name,want", [("float32", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16),
                                       ("BFloat16", torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                       ("float16", torch.float16)])
def test_names(name, want):
    assert D.resolve_dtype(name) is want


@pytest.mark.parametrize("bad", ["int8", "float64", torch.float64, "", "bfloat"])
def test_bad_names_name_the_choices(bad):
    with pytest.raises(ValueError, match="dtype must be"):
        D.resolve_dtype(bad)


@pytest.mark.parametrize("native,want", [((True, "AMX"), torch.bfloat16), ((False, "no AMX / AVX512-BF16"), torch.float32)])
def test_auto_follows_the_cpu(monkeypatch, capsys, native, want):
    monkeypatch.setattr(D, "cpu_bf16", lambda: native)
    monkeypatch.setattr(D, "_warned", set())
    assert D.resolve_dtype("auto") is want
    assert D.resolve_dtype(None) is want
    err = capsys.readouterr().err
    assert ("-> float32" in err) == (want is torch.float32) and err.count("\n") <= 1  # one message, once


def test_cpu_probe_reports_a_feature_or_why_not():
    ok, why = D.cpu_bf16()
    assert isinstance(ok, bool) and (why in ("AMX", "AVX512-BF16")) == ok
