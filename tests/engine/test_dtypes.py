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
    """Both branches of the CPU check on any machine; resolving prints nothing (the CLI prints the reason
    on stdout), and the explanation names the feature or why bf16 is not native."""
    monkeypatch.setattr(D, "cpu_bf16", lambda: native)
    assert D.resolve_dtype("auto") is want
    assert D.resolve_dtype(None) is want
    note = D.explain_dtype("auto")
    assert note.startswith(D.dtype_name(want) + " (auto") and native[1] in note
    assert ("emulated" in note) == (not native[0])
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err == ""


@pytest.mark.parametrize("native", [(True, "AVX512-BF16"), (False, "no AMX / AVX512-BF16 on this CPU")])
def test_explicit_bf16_is_honoured_on_every_cpu(monkeypatch, native):
    monkeypatch.setattr(D, "cpu_bf16", lambda: native)
    assert D.resolve_dtype("bfloat16") is torch.bfloat16
    note = D.explain_dtype("bf16")
    assert note.startswith("bfloat16 (asked for") and ("emulated" in note) == (not native[0])
    assert D.explain_dtype("float32") == "float32 (asked for)"


def test_cpu_probe_reports_a_feature_or_why_not():
    ok, why = D.cpu_bf16()
    assert isinstance(ok, bool) and (why in ("AMX", "AVX512-BF16")) == ok
