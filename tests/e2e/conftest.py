"""End-to-end fixtures: real SGLang 0.5.23 engines on the CPU (demo target + shipped draft), each in its
own host process (:mod:`tests.e2e.engine_host`), one per test module, stopped in teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

HOST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_host.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARK = "@@treespec@@ "
START_TIMEOUT = 600


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
    import treespec_sglang

    return os.path.join(os.path.dirname(treespec_sglang.__file__), "assets", "smollm2-135m-eagle")


class EngineHost:
    """A running engine in a child process; ``generate(**kw)`` returns ``sgl.Engine.generate``'s result."""

    def __init__(self, name: str, engine_kwargs: dict, log_dir: str):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1"}
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, HOST, json.dumps(engine_kwargs)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT)
        msg = self._read(START_TIMEOUT)
        if not msg["ok"]:
            self.close()
            raise RuntimeError(f"engine {name} failed to start: {msg['error']}\n{self.tail()}")
        self.start_seconds = msg["seconds"]
        self.request_seconds = []

    def tail(self, n=4000) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def _read(self, timeout: float) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine {self.name} exited:\n{self.tail()}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise TimeoutError(f"engine {self.name}: no answer in {timeout} s")

    def call(self, timeout: float = 900, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": "generate", "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        msg = self._read(timeout)
        self.request_seconds.append(msg["seconds"])
        return msg

    def generate(self, **kwargs):
        msg = self.call(**kwargs)
        if not msg["ok"]:
            raise RuntimeError(msg["error"])
        return msg["result"]

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def engine_kwargs(target: str, **spec) -> dict:
    kw = dict(model_path=target, device="cpu", attention_backend="intel_amx", dtype="float32",
              disable_cuda_graph=True, max_total_tokens=8192, max_running_requests=32, log_level="warning",
              random_seed=0)
    kw.update(spec)
    return kw


def eagle_kwargs(draft: str, topk=4, steps=3, n=8, **extra) -> dict:
    return dict(speculative_algorithm="EAGLE", speculative_draft_model_path=draft, speculative_eagle_topk=topk,
                speculative_num_steps=steps, speculative_num_draft_tokens=n,
                speculative_token_map=os.path.join(draft, "token_map.pt"), **extra)


@pytest.fixture(scope="session")
def demo_target_dir():
    return _require()


@pytest.fixture(scope="session")
def host_factory(tmp_path_factory):
    """Start an engine host; the caller closes it (module-scoped fixtures do so in teardown)."""
    logs = str(tmp_path_factory.mktemp("engines"))

    def start(name, kwargs):
        return EngineHost(name, kwargs, logs)

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

    return SpecEngine.from_pretrained("smollm2-135m", draft="demo")


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
