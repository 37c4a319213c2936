"""The plugin in real SGLang on a CUDA GPU, CUDA graphs on: runs against any SGLang 0.5.23-on-CUDA install (a
user's own, or the GPU test bed) and skips cleanly without a CUDA device or SGLang.

Per configuration (EAGLE 4/3/8 and 8/5/32 with the shipped head and token map, EAGLE-3 4/3/8): native EAGLE,
every policy alone, every policy mixed with native requests and every policy without a native row equal
plain greedy; every treespec round replays SGLang's draft, verify and draft-extend graphs (counted through
``TREESPEC_GRAPH_LOG``: no eager fallback). Besides: plain SGLang equals transformers greedy, the T = 1 law
test, and ``launch_server`` with the OpenAI client and ``/metrics``.

Float32. A greedy mismatch on a GPU passes only as a documented near-tie: the first differing token's two
candidates are within ``NEAR_TIE`` of each other in the target's own logits at that position (transformers,
float32, this GPU), and the test prints the margin. ``TREESPEC_GPU_ATTENTION=flashinfer`` runs SGLang's
FlashInfer backend (the custom-mask verify path) instead of Triton, in bf16 (FlashInfer has no float32 kernels),
where a near-tie is one within bf16's bound (:data:`~treespec_sglang.engine.exactness.TIE_BOUND`); ``TREESPEC_SELECT=triton`` (inherited by
the engines' processes) selects every tree with the fused Triton kernel instead of the torch selection.
"""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.e2e.conftest import (N_NEW, POLICIES, free_port, get, greedy_params, same_tokens,  # noqa: E402
                                serving, shipped_draft)
from tests.e2e.law import Z2, chi2_stat, chi2_threshold, draw_pairs, temperature_z  # noqa: E402
from treespec_sglang.engine.exactness import TIE_BOUND  # noqa: E402
from treespec_sglang.plugin.cpu.host import eagle_kwargs  # noqa: E402
from treespec_sglang.plugin.graph_log import ENV_GRAPH_LOG, read_counts  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.sglang, pytest.mark.e2e, pytest.mark.slow]

ATTENTION = os.environ.get("TREESPEC_GPU_ATTENTION", "triton")
DTYPE = "bfloat16" if ATTENTION == "flashinfer" else "float32"  # FlashInfer's JIT takes fp16, bf16 and fp8 only
# logits: float32 kernels of different shapes order closer candidates either way; bf16 rounds far more
NEAR_TIE = 0.01 if DTYPE == "float32" else TIE_BOUND
CONFIGS = {"eagle-4-3-8": (4, 3, 8, "EAGLE"), "eagle-8-5-32": (8, 5, 32, "EAGLE"), "eagle3-4-3-8": (4, 3, 8, "EAGLE3")}


def policies(topk, steps, n):
    """Every policy sized for a (topk, steps, N) pool (the CPU tests' POLICIES at 4/3/8)."""
    return {"eagle2": {"policy": "eagle2", "budget": n, "topk": topk, "depth": steps},
            "talon": {"policy": "talon", "budget": n, "topk": topk, "mu": 0.03},
            "salf": {"policy": "salf", "budget": n, "th": 0.1}, "c2t": {"policy": "c2t", "budget": n, "topk": topk,
                                                                         "beta": 0.5},
            "chain": {"policy": "chain", "length": steps}, "none": {"policy": "none"}}


def gpu_engine_kwargs(target, **spec):
    """``sgl.Engine`` arguments on a CUDA GPU: float32 (bf16 with FlashInfer), decode / draft / verify /
    draft-extend graphs on (the prefill graph off: a minute per start, and no speculative round replays it)."""
    kw = dict(model_path=target, dtype=DTYPE, attention_backend=ATTENTION,
              sampling_backend="flashinfer" if ATTENTION == "flashinfer" else "pytorch", mem_fraction_static=0.35,
              cuda_graph_max_bs_decode=32, max_running_requests=32, random_seed=0, log_level="warning",
              disable_prefill_cuda_graph=True)
    kw.update(spec)
    return kw


def _require_sglang():
    sglang = pytest.importorskip("sglang")
    from treespec_sglang.plugin import SGLANG_VERSION

    if sglang.__version__ != SGLANG_VERSION:
        pytest.skip(f"plugin pins sglang {SGLANG_VERSION}, found {sglang.__version__}")
    return sglang


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("graphs"))
    os.environ[ENV_GRAPH_LOG] = d  # inherited by the engines' scheduler processes
    yield d
    os.environ.pop(ENV_GRAPH_LOG, None)


@pytest.fixture(scope="module")
def hf_target(demo_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_target_dir, dtype=torch.float32).cuda().eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_target, prompt_ids):
    """transformers float32 greedy on this GPU: the reference plain SGLang must equal."""
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            g = hf_target.generate(torch.tensor([ids], device="cuda"), max_new_tokens=N_NEW, do_sample=False,
                                   eos_token_id=2, pad_token_id=2)
            outs.append(g[0, len(ids):].tolist())
    return outs


def near_tie_margin(hf_target, prompt, ours, ref):
    """The target's logit margin between the two tokens at the first position where ``ours`` and ``ref``
    part (None when they agree on their common length)."""
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if i is None:
        return None
    with torch.inference_mode():
        logits = hf_target(torch.tensor([list(prompt) + list(ref[:i])], device="cuda")).logits[0, -1].float()
    return abs(float(logits[ours[i]] - logits[ref[i]]))


def check_equal(outs, refs, prompts, hf_target, label):
    """Every output equals its reference, or parts from it at a documented near-tie (printed)."""
    for k, (o, ref) in enumerate(zip(outs, refs)):
        ids = o["output_ids"] if isinstance(o, dict) else o
        if same_tokens(ids, ref):
            continue
        margin = near_tie_margin(hf_target, prompts[k % len(prompts)], ids, ref)
        assert margin is not None and margin < NEAR_TIE, (label, k, margin, ids, ref)
        print(f"{label}: request {k} parts from plain greedy at a near-tie, logit margin {margin:.2e}",
              file=sys.stderr)


@pytest.fixture(scope="module")
def gpu_plain(demo_target_dir, prompt_ids, graph_dir):
    """Plain SGLang greedy on this GPU (the reference of the speculative engines); the engine stops at once,
    so at most one SGLang engine (plus the launch_server test's) holds GPU memory at a time."""
    sgl = _require_sglang()
    llm = sgl.Engine(**gpu_engine_kwargs(demo_target_dir))
    try:
        outs = llm.generate(input_ids=prompt_ids, sampling_params=[greedy_params()] * len(prompt_ids))
    finally:
        llm.shutdown()
    return [o["output_ids"] for o in outs]


def test_plain_sglang_equals_transformers_greedy(gpu_plain, hf_greedy, prompt_ids, hf_target):
    check_equal(gpu_plain, hf_greedy, prompt_ids, hf_target, "plain vs transformers")


def draft_dir(algo):
    if algo == "EAGLE3":
        from treespec_sglang.engine.loading import eagle3_draft_dir

        return eagle3_draft_dir()
    return shipped_draft()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def spec(request, demo_target_dir, gpu_plain, graph_dir):
    """One speculative engine per configuration (after plain: ``gpu_plain`` is computed first)."""
    sgl = _require_sglang()
    topk, steps, n, algo = CONFIGS[request.param]
    llm = sgl.Engine(**gpu_engine_kwargs(demo_target_dir, **eagle_kwargs(draft_dir(algo), topk, steps, n,
                                                                         algorithm=algo)))
    yield request.param, llm, policies(topk, steps, n), n
    llm.shutdown()


def test_every_policy_equals_plain_greedy_and_replays_sglangs_graphs(spec, prompt_ids, gpu_plain, hf_target,
                                                                     graph_dir):
    """Native alone, each policy alone, every policy mixed with native requests, every policy without a
    native row: plain greedy (or a documented near-tie), stats on every treespec request; then no treespec
    round of this engine ran a graph runner eagerly."""
    name, llm, pol, n = spec
    before = read_counts(graph_dir)
    batches = {"native": [None]} | {f"only-{k}": [v] for k, v in pol.items()}
    batches["mixed"] = [pol[k] for k in sorted(pol)] + [None]
    batches["all-policy"] = [pol[k] for k in sorted(pol)]
    for label, specs in batches.items():
        ids = [p for p in prompt_ids for _ in specs]
        outs = llm.generate(input_ids=ids, sampling_params=[greedy_params(s) for _ in prompt_ids for s in specs])
        refs = [r for r in gpu_plain for _ in specs]
        check_equal(outs, refs, [p for p in prompt_ids for _ in specs], hf_target, f"{name} {label}")
        for o, s in zip(outs, specs * len(prompt_ids)):
            meta = o["meta_info"]
            if s is not None:
                assert meta["treespec_policy"] == [s["policy"]], (label, meta)
                assert all(1 <= t <= n for t in meta["treespec_tree_sizes"])
    counts = read_counts(graph_dir) - before
    eager = {k: v for k, v in counts.items() if k.endswith("|False|ts")}
    replayed = {k.split("|")[0] for k, v in counts.items() if k.endswith("|True|ts") and v > 0}
    print(f"{name} graph decisions: {dict(counts)}", file=sys.stderr)
    assert not eager, eager  # no treespec round fell back to eager
    assert {"DecodeCudaGraphRunner", "EAGLEDraftCudaGraphRunner", "EAGLEDraftExtendCudaGraphRunner"} <= replayed


@pytest.fixture
def chain_engine(demo_target_dir, gpu_plain, graph_dir):
    """A chain-mode engine (EAGLE, topk 1, 5 steps, N 6), after plain; shut down after its test (with a ``spec``
    engine and the launch_server test's, at most three hold GPU memory at once)."""
    sgl = _require_sglang()
    llm = sgl.Engine(**gpu_engine_kwargs(demo_target_dir, **eagle_kwargs(shipped_draft(), 1, 5, 6)))
    yield llm
    llm.shutdown()


def test_chain_mode_policies_equal_plain_greedy(chain_engine, prompt_ids, gpu_plain, hf_target):
    """Chain mode on a GPU: C2T stops (their rounds draft eagerly, the loop recording its statistics), a shorter
    chain and speculation off (the draft graph replays), alone and mixed with native requests, equal plain greedy
    (or a documented near-tie), each request's chain at most N long. The C2T stop once read its statistics under
    the worker's device name ("cuda") where the loop wrote them under the logits' ("cuda:0"): every C2T round
    raised on a GPU, and no GPU test drafted chains."""
    specs = [{"policy": "chain", "beta": 0.5}, {"policy": "chain", "length": 2}, {"policy": "none"}, None]
    for label, batch in {"c2t": specs[:1], "mixed": specs}.items():
        ids = [p for p in prompt_ids for _ in batch]
        outs = chain_engine.generate(input_ids=ids, sampling_params=[greedy_params(s) for _ in prompt_ids
                                                                     for s in batch])
        check_equal(outs, [r for r in gpu_plain for _ in batch], ids, hf_target, f"chain {label}")
        for o, s in zip(outs, batch * len(prompt_ids)):
            if s is not None:
                meta = o["meta_info"]
                assert meta["treespec_policy"] == [s["policy"]], (label, meta)
                top = {"none": 1, "chain": 6 if "beta" in s else 3}[s["policy"]]
                assert all(1 <= t <= top for t in meta["treespec_tree_sizes"]), (label, s, meta)


@pytest.fixture
def ragged_engine(demo_target_dir, gpu_plain, graph_dir):
    """An engine (EAGLE 4/3/8) verifying compactable batches ragged (``TREESPEC_RAGGED_VERIFY=1``, read by its
    processes at start), FlashInfer only: the ragged verify on a GPU is FlashInfer's paged ``plan()`` over the
    compacted arguments. Shut down after its test."""
    if ATTENTION != "flashinfer":
        pytest.skip("a GPU verifies ragged through FlashInfer only (TREESPEC_GPU_ATTENTION=flashinfer)")
    sgl = _require_sglang()
    os.environ["TREESPEC_RAGGED_VERIFY"] = "1"  # inherited by the engine's scheduler processes
    try:
        llm = sgl.Engine(**gpu_engine_kwargs(demo_target_dir, **eagle_kwargs(shipped_draft(), 4, 3, 8)))
    finally:
        os.environ.pop("TREESPEC_RAGGED_VERIFY", None)
    yield llm
    llm.shutdown()


def test_flashinfer_ragged_verify_runs_each_tree_at_its_size(ragged_engine, prompt_ids, gpu_plain, hf_target,
                                                             graph_dir):
    """Small trees (a 2-token chain, speculation off, a 3-node TALON) beside native requests, verified ragged
    through FlashInfer: plain greedy (or a documented bf16 near-tie), each treespec request verified exactly its
    own tree each round (never padded to N), and the target's verify counted eager in those rounds (its graph
    holds bs * N tokens) while the draft graph still replays."""
    specs = [{"policy": "chain", "length": 2}, {"policy": "none"}, None,
             {"policy": "talon", "budget": 3, "topk": 4, "mu": 0.03}]
    before = read_counts(graph_dir)
    ids = [p for p in prompt_ids for _ in specs]
    outs = ragged_engine.generate(input_ids=ids, sampling_params=[greedy_params(s) for _ in prompt_ids for s in specs])
    check_equal(outs, [r for r in gpu_plain for _ in specs], ids, hf_target, "flashinfer ragged")
    for o, s in zip(outs, specs * len(prompt_ids)):
        if s is None:
            continue
        sizes, verified = o["meta_info"]["treespec_tree_sizes"], o["meta_info"]["treespec_verify_tokens"]
        assert sizes and len(verified) == len(sizes), (s, sizes, verified)
        assert all(v == t <= 3 for t, v in zip(sizes, verified)), (s, sizes, verified)
    counts = read_counts(graph_dir) - before
    print(f"flashinfer ragged graph decisions: {dict(counts)}", file=sys.stderr)
    assert counts["DecodeCudaGraphRunner|TARGET_VERIFY|False|ts"] > 0, counts
    assert counts["EAGLEDraftCudaGraphRunner|DECODE|True|ts"] > 0, counts


def test_sampled_tokens_follow_the_target_law(spec, sample_law):
    """T = 1, a treespec policy (talon) in SGLang's GPU sampling verify: the first two tokens' joint law and the
    second token's temperature match the float32 target's (the CPU test's chi-square and z tests)."""
    name, llm, pol, _ = spec
    if name != "eagle-4-3-8":
        pytest.skip("one configuration is enough for the law (1200 draws)")

    ids, law, cond, _ = sample_law
    samples = draw_pairs(llm, ids, 1.0, pol["talon"])  # an in-process engine answers EngineHost's generate call
    stat, bins = chi2_stat(samples, law)
    assert bins >= 8 and stat < chi2_threshold(bins), (stat, bins)
    z = temperature_z(samples, cond)
    assert abs(z) < Z2, z


def test_launch_server_with_the_openai_client_and_metrics(demo_target_dir, prompt_ids, spec_engine, tmp_path):
    """``python -m sglang.launch_server`` on the GPU with the plugin: an OpenAI completion with a policy in
    ``extra_body`` returns native EAGLE's text (itself plain greedy's, tested above), a bad value is a 400
    naming the field, and ``/metrics`` carries the plugin's series."""
    _require_sglang()
    openai = pytest.importorskip("openai")
    port = free_port()
    argv = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port),
            "--enable-metrics"]
    for k, v in gpu_engine_kwargs(demo_target_dir, **eagle_kwargs(shipped_draft(), 4, 3, 8)).items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [] if v is False else [flag, str(v)]
    with serving(argv, tmp_path / "server.log", port=port, cpu=False) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        kw = dict(model="default", prompt=spec_engine.tokenizer.decode(prompt_ids[0]), max_tokens=N_NEW, temperature=0)
        native = client.completions.create(**kw).choices[0].text
        ours = client.completions.create(**kw, extra_body={"custom_params": {"treespec": POLICIES["talon"]}})
        assert ours.choices[0].text == native and native
        with pytest.raises(openai.BadRequestError, match=r"talon.budget must be in \[1, 1024\], got 0"):
            client.completions.create(**kw, extra_body={"custom_params": {"treespec": {"policy": "talon", "budget": 0}}})
        assert "treespec:rounds_total" in get(base + "/metrics")
