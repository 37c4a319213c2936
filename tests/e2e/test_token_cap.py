"""Real SGLang 0.5.23 on the CPU with ``--treespec-token-cap`` (``TREESPEC_TOKEN_CAP``): one token cap
for the treespec requests of each round, on top of ragged verify, mixed with an opted-out request per prompt and
native requests; greedy output equals plain greedy everywhere."""

import pytest

from tests.e2e.conftest import cpu_engine_kwargs, eagle_kwargs, greedy_params, same_tokens, shipped_draft

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]

TOPK, STEPS, N, PER_REQUEST = 4, 3, 8, 3
SHARED = {"policy": "eagle2", "budget": N, "topk": TOPK, "depth": STEPS}
TALON = {"policy": "talon", "budget": N, "topk": TOPK, "mu": 0.01}
OWN = dict(SHARED, token_cap=False)


@pytest.fixture(scope="module")
def capped(host_factory, demo_target_dir):
    h = host_factory("token-cap", cpu_engine_kwargs(demo_target_dir, **eagle_kwargs(shipped_draft(), TOPK, STEPS, N)),
                     env={"TREESPEC_TOKEN_CAP": str(PER_REQUEST), "TREESPEC_RAGGED_VERIFY": "1"})
    yield h
    h.close()


def test_token_cap_is_lossless_respected_and_moves_between_requests(capped, prompt_ids, plain_greedy):
    kinds = ["shared", "talon", "own", None]
    specs = {"shared": SHARED, "talon": TALON, "own": OWN, None: None}
    ids = [p for p in prompt_ids for _ in kinds]
    outs = capped.generate(input_ids=ids, sampling_params=[greedy_params(specs[k]) for _ in prompt_ids for k in kinds])
    shared_sizes = []
    for i, o in enumerate(outs):
        kind, meta = kinds[i % len(kinds)], o["meta_info"]
        assert same_tokens(o["output_ids"], plain_greedy[i // len(kinds)]), kind
        if kind is None:
            assert not meta.get("treespec_tree_sizes")
            continue
        sizes = meta["treespec_tree_sizes"]
        verified = meta["treespec_verify_tokens"]  # ragged: a tree verify runs the batch's widest kept tree
        assert len(verified) == len(sizes) and all(s <= v <= N for s, v in zip(sizes, verified))
        if kind == "own":
            assert set(sizes) == {N}, sizes  # opted out: its whole eagle2 tree every round
        else:
            shared_sizes += sizes
    # every round's sharing requests verify <= PER_REQUEST tokens each on average, so the mean over all
    # (request, round) pairs does too; the cap moves: some request gets more than its share in some round
    assert sum(shared_sizes) <= PER_REQUEST * len(shared_sizes)
    assert max(shared_sizes) > PER_REQUEST and min(shared_sizes) < PER_REQUEST
    assert capped.method("flush_cache")
