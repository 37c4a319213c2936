"""End-to-end fixtures: real SGLang 0.5.23 engines on the CPU (demo target + shipped draft), each in its
own host process (:mod:`treespec_sglang.plugin.cpu.host`), one per test module, stopped in teardown."""

from __future__ import annotations

import os

import pytest

from treespec_sglang.plugin.cpu.host import EngineHost, cpu_engine_kwargs, eagle_kwargs  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _require():
    sglang = pytest.importorskip("sglang")
    from treespec_sglang.plugin import SGLANG_VERSION

    if sglang.__version__ != SGLANG_VERSION:
        pytest.skip(f"plugin pins sglang {SGLANG_VERSION}, found {sglang.__version__}")
    try:
        from treespec_sglang.models.demo import demo_target

        return demo_target()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"demo target unavailable: {e}")


def shipped_draft() -> str:
    from treespec_sglang.engine.loading import demo_draft_dir

    return demo_draft_dir()


@pytest.fixture(scope="session")
def demo_target_dir():
    return _require()


@pytest.fixture(scope="session")
def host_factory(tmp_path_factory):
    """Start an engine host; the caller closes it (module-scoped fixtures do so in teardown)."""
    logs = str(tmp_path_factory.mktemp("engines"))

    def start(name, kwargs, env=None):
        # SGLang's own idle-time pool invariant check, strict: a leaked or double-freed KV slot kills the engine
        return EngineHost(name, kwargs, logs, cwd=ROOT, env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
                                                            **(env or {})})

    return start


N_NEW = 32  # new tokens per greedy request


@pytest.fixture(scope="session")
def prompt_ids(demo_target_dir, spec_engine):
    """Four held-out prompts (every 10th of HumanEval and MT-bench), chat-templated token ids."""
    from treespec_sglang.data.prompts import humaneval, mtbench

    try:
        texts = humaneval().every(10).take(2).prompts + mtbench().every(10).take(2).prompts
    except FileNotFoundError as e:
        pytest.skip(f"prompt data unavailable: {e}")
    return spec_engine.encode(texts)


@pytest.fixture(scope="session")
def spec_engine(demo_target_dir):
    from treespec_sglang.engine import SpecEngine

    return SpecEngine.from_pretrained("smollm2-135m", draft="demo", dtype="float32")


@pytest.fixture(scope="session")
def plain_greedy(spec_engine, prompt_ids):
    """Our engine's plain float32 greedy continuation of each prompt (the reference every run must equal)."""
    return [r.token_ids for r in spec_engine.generate(prompt_ids, max_new_tokens=N_NEW)]


def greedy_params(custom=None, n=N_NEW) -> dict:
    sp = {"max_new_tokens": n, "temperature": 0.0}
    if custom is not None:
        sp["custom_params"] = {"treespec": custom}
    return sp


def same_tokens(sglang_ids, ref_ids) -> bool:
    """SGLang's output_ids vs our engine's tokens (both stop at EOS; ours keeps it, SGLang may not)."""
    n = min(len(sglang_ids), len(ref_ids))
    return list(sglang_ids[:n]) == list(ref_ids[:n]) and abs(len(sglang_ids) - len(ref_ids)) <= 1 and n > 0


def resaved_draft(out_dir: str, dtype) -> str:
    """The shipped draft written again by our own checkpoint writer (what ``treespec train`` writes)."""
    import shutil

    import torch  # noqa: F401

    from treespec_sglang.models.draft_head import EagleDraftHead

    src = shipped_draft()
    EagleDraftHead.load(src).save(out_dir, dtype=dtype)
    shutil.copy(os.path.join(src, "token_map.pt"), os.path.join(out_dir, "token_map.pt"))
    return out_dir
