"""End-to-end fixtures: real SGLang 0.5.23 engines on the CPU (demo target + shipped draft), each in its
own host process (:mod:`treespec_sglang.plugin.cpu.host`), one per test module, stopped in teardown."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.helpers import ROOT, checkout_env
from treespec_sglang.plugin.cpu.host import EngineHost, cpu_engine_kwargs, eagle_kwargs  # noqa: F401


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
TOPK, STEPS, N = 4, 3, 8  # the EAGLE engines' pool: topk, draft steps, verified tokens
POLICIES = {  # one spec of every tree policy, sized for that pool
    "eagle2": {"policy": "eagle2", "budget": N, "topk": TOPK, "depth": STEPS},
    "talon": {"policy": "talon", "budget": N, "topk": TOPK, "mu": 0.03},
    "salf": {"policy": "salf", "budget": N, "th": 0.1},  # batch unset: min(10, budget)
    "c2t": {"policy": "c2t", "budget": N, "topk": TOPK, "beta": 0.5},
    "chain": {"policy": "chain", "length": STEPS},
}


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
def sample_law(spec_engine):
    """Exact law of the first two tokens at T = 1 from the float32 target: ``(ids, {(t1, t2): p}, cond)``,
    ``cond[t1]`` the ``[vocab]`` float64 log-probs of the second token after each of the 24 likeliest t1."""
    import torch

    from tests.e2e.law import SAMPLE_PROMPT

    ids = spec_engine.encode([SAMPLE_PROMPT])[0]
    with torch.inference_mode():
        from treespec_sglang.engine.kv_cache import prefill

        def next_logprobs(seqs):
            cache, inp, hidden, lens = prefill(spec_engine.target, seqs, max(len(s) for s in seqs) + 1)
            last = torch.gather(hidden, 1, (lens - 1)[:, None, None].expand(len(seqs), 1, hidden.shape[-1]))[:, 0]
            return torch.log_softmax(spec_engine.calls.logits(last).double(), -1)

        p1 = next_logprobs([ids])[0].exp()
        top1 = torch.topk(p1, 24).indices.tolist()
        lp2 = next_logprobs([ids + [t] for t in top1])
    law = {}
    for row, t1 in enumerate(top1):
        for t2 in torch.topk(lp2[row], 24).indices.tolist():
            law[(t1, t2)] = float(p1[t1] * lp2[row, t2].exp())
    cond = {t1: lp2[row] for row, t1 in enumerate(top1)}
    return ids, law, cond, {t1: float(p1[t1]) for t1 in top1}


@pytest.fixture(scope="session")
def plain_greedy(spec_engine, prompt_ids):
    """Our engine's plain float32 greedy continuation of each prompt (the reference every run must equal)."""
    return [r.token_ids for r in spec_engine.generate(prompt_ids, max_new_tokens=N_NEW)]


def every_policy_and_native(prompt_ids, plain_greedy, native=True):
    """Every prompt under every policy of POLICIES (and natively unless ``native`` is False: a batch with no
    native row, whose rounds hand SGLang only the plugin's trees), for one call: (ids, params, [(name, ref)])."""
    names = sorted(POLICIES) + ([None] if native else [])
    ids, params, refs = [], [], []
    for p, ref in zip(prompt_ids, plain_greedy):
        for name in names:
            ids.append(p)
            params.append(greedy_params(POLICIES[name] if name else None))
            refs.append((name, ref))
    return ids, params, refs


def check_every_policy_batch(host, prompt_ids, plain_greedy, native=True):
    """Every prompt under every policy (and natively unless ``native`` is False) in one call to ``host``: each
    output == plain greedy; a policy row's ``meta_info`` names it and agrees with SGLang's counters, a native row
    carries no treespec keys (SGLang pads request-level keys of a shared output batch with empty lists)."""
    ids, params, refs = every_policy_and_native(prompt_ids, plain_greedy, native)
    outs = host.generate(input_ids=ids, sampling_params=params)
    for o, (name, ref) in zip(outs, refs):
        assert same_tokens(o["output_ids"], ref), name
        if name:
            assert o["meta_info"]["treespec_policy"] == [name]
            check_meta(o["meta_info"], o["meta_info"]["completion_tokens"])
        else:
            assert not o["meta_info"].get("treespec_policy") and not o["meta_info"].get("treespec_tree_sizes")


BAD = [({"policy": "nope"}, "policy must be one of"),  # malformed treespec values, each with what its error names
       ({"policy": "talon", "budget": 0}, "talon.budget must be in [1, 1024], got 0"),
       ({"policy": "salf", "budget": 8, "batch": 4, "th": float("nan")}, "salf.th"),
       ({"policy": "talon", "budget": "sixty"}, "talon.budget"),
       ("talon", "policy spec must be a dict")]


def check_bad_items_fail_alone(host, prompt_ids, plain_greedy):
    """One batch call of a good talon request beside each malformed one of :data:`BAD`: each bad item finishes
    as an abort naming its field, each good one equals plain greedy."""
    params, expect = [], []
    for bad, msg in BAD:
        params += [greedy_params(POLICIES["talon"]), greedy_params(bad)]
        expect += [None, msg]
    ids = [prompt_ids[i % len(prompt_ids)] for i in range(len(params))]
    outs = host.generate(input_ids=ids, sampling_params=params)
    for i, (o, msg) in enumerate(zip(outs, expect)):
        fr = o["meta_info"]["finish_reason"]
        if msg is None:
            assert same_tokens(o["output_ids"], plain_greedy[i % len(prompt_ids)])
            assert fr["type"] in ("length", "stop")
        else:
            assert fr["type"] == "abort" and "custom_params['treespec']" in fr["message"], fr
            assert msg in fr["message"], fr


def greedy_params(custom=None, n=N_NEW) -> dict:
    sp = {"max_new_tokens": n, "temperature": 0.0}
    if custom is not None:
        sp["custom_params"] = {"treespec": custom}
    return sp


def check_meta(meta, completion_tokens):
    """A treespec request's ``meta_info`` against SGLang's own counters: tree sizes within 1..N, accept lengths
    within 0..S and as many as SGLang's verify rounds (their sum its accepted drafts), the completion tokens they
    produce; returns the tree sizes."""
    sizes, accepts = meta["treespec_tree_sizes"], meta["treespec_accept_lengths"]
    assert all(1 <= s <= N for s in sizes), sizes
    assert all(0 <= a <= STEPS for a in accepts), accepts
    assert len(accepts) == meta["spec_verify_ct"] and sum(accepts) == meta["spec_num_correct_drafts"]
    # the first token comes from the prefill, every round commits accepts + 1 (the last may be cut)
    produced = 1 + sum(a + 1 for a in accepts)
    assert produced - (STEPS + 1) < completion_tokens <= produced
    # SGLang's spec_accept_length counts every completion token (the prefill's too) per verify round
    assert math.isclose(completion_tokens / len(accepts), meta["spec_accept_length"], rel_tol=1e-6)
    return sizes


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=300):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def get(url, timeout=60) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def stop(proc):
    """Stop the server's whole process group (the launcher and the scheduler / detokenizer it spawned)."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # already gone
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="session")
def classifier_file(tmp_path_factory) -> str:
    """A C2T classifier file the server registers as ``fast`` (the hand-set default's weights)."""
    from treespec_sglang.policies.classifier import C2TClassifier

    path = str(tmp_path_factory.mktemp("c2t") / "fast.pt")
    C2TClassifier.default().save(path)
    return path


@contextlib.contextmanager
def serving(argv, log_path, health="/health", port=None, cpu=True):
    """Run ``argv`` (a server listening on ``port``) in its own process group until ``health`` answers;
    yield its base URL; stop the whole group on exit. ``cpu``: with SGLang's CPU-engine environment."""
    from treespec_sglang.plugin.cpu.host import CPU_ENV

    env = checkout_env(**(CPU_ENV if cpu else {}))
    log = open(log_path, "w+")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"{argv[2]} exited ({proc.returncode}):\n{log.read()[-4000:]}")
            try:
                urllib.request.urlopen(base + health, timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.time() - t0 > 600:
                    pytest.fail(f"{argv[2]} did not become healthy in 600 s")
                time.sleep(2)
        yield base
    finally:
        stop(proc)
        log.close()


def eagle_server_argv(target: str, draft: str, port: int, classifier_file: str) -> list:
    """``python -m sglang.launch_server`` on the CPU: EAGLE topk 4 / steps 3 / N 8, ``--enable-metrics`` and a
    registered classifier ``fast``."""
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", target, "--device", "cpu",
            "--attention-backend", "intel_amx", "--dtype", "float32", "--disable-cuda-graph", "--sleep-on-idle",
            "--max-total-tokens", "8192", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            "--enable-metrics", "--treespec-classifier", f"fast={classifier_file}"]
    for k, v in eagle_kwargs(draft).items():
        args += ["--" + k.replace("_", "-"), str(v)]
    return args


@pytest.fixture(scope="session")
def server(demo_target_dir, tmp_path_factory, classifier_file):
    """One ``python -m sglang.launch_server`` for the session's HTTP tests (:func:`eagle_server_argv`), the
    draft written by our checkpoint writer in bfloat16; stopped in teardown."""
    import torch

    draft = resaved_draft(str(tmp_path_factory.mktemp("draft-bf16")), torch.bfloat16)
    port = free_port()
    with serving(eagle_server_argv(demo_target_dir, draft, port, classifier_file),
                 tmp_path_factory.mktemp("server") / "server.log", port=port) as base:
        yield base
