"""Scale-out past one server: two ``launch_server`` EAGLE workers behind SGLang's router (``sglang-router``
0.3.2 from PyPI, round robin). Per-request ``custom_params`` reach both workers through the OpenAI API (each
worker's ``/metrics`` counts its treespec requests), outputs equal a worker's own native greedy output, and a
bad value is the worker's HTTP 400. (The router's native ``/generate`` drops ``custom_params``: README.)"""

import sys

import pytest
import torch

from tests.e2e.conftest import eagle_server_argv, free_port, resaved_draft, serving

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]

TALON = {"policy": "talon", "budget": 8, "topk": 4, "mu": 0.03}


@pytest.fixture(scope="module")
def router(server, demo_target_dir, tmp_path_factory, classifier_file):
    """The session's server and a second worker like it, behind ``sglang_router`` (round robin)."""
    pytest.importorskip("sglang_router")
    tmp = tmp_path_factory.mktemp("router")
    draft = resaved_draft(str(tmp / "draft"), torch.bfloat16)
    port_b, port_r = free_port(), free_port()
    with serving(eagle_server_argv(demo_target_dir, draft, port_b, classifier_file), tmp / "worker-b.log",
                 port=port_b) as worker_b:
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", server, worker_b,
                "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port_r), "--log-level", "warn"]
        with serving(argv, tmp / "router.log", health="/health", port=port_r) as base:
            yield base, (server, worker_b)


def talon_requests(base) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    from tests.e2e.conftest import get

    return sum(s.value for fam in text_string_to_metric_families(get(base + "/metrics")) for s in fam.samples
               if s.name == "treespec:requests_total" and s.labels.get("policy") == "talon")


def test_per_request_policies_reach_every_worker_through_the_router(router, prompt_ids, spec_engine):
    openai = pytest.importorskip("openai")
    base, workers = router
    prompt = spec_engine.tokenizer.decode(prompt_ids[1])
    kw = dict(model="default", prompt=prompt, max_tokens=24, temperature=0)
    native = openai.OpenAI(base_url=workers[0] + "/v1", api_key="none").completions.create(**kw).choices[0].text
    before = [talon_requests(w) for w in workers]
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    texts = [client.completions.create(**kw, extra_body={"custom_params": {"treespec": TALON}}).choices[0].text
             for _ in range(4)]
    assert texts == [native] * 4 and native
    served = [talon_requests(w) - b for w, b in zip(workers, before)]
    assert sum(served) == 4 and min(served) >= 1, served  # both workers ran talon requests
    with pytest.raises(openai.BadRequestError, match="policy must be one of"):
        client.completions.create(**kw, extra_body={"custom_params": {"treespec": {"policy": "nope"}}})
