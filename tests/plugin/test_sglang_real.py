"""The plugin against the real sglang==0.5.23 (CPU): discovery, hook application, signatures,
SGLang's own draft-tree functions vs our EAGLE-2, custom_params validation, server flags (the round hooks:
``test_sglang_rounds.py``)."""

import inspect
import os

import pytest
import torch

pytestmark = pytest.mark.sglang
sglang = pytest.importorskip("sglang")

from tests.helpers import PathDraft  # noqa: E402
from tests.plugin.sglang_loop import sglang_draft_loop  # noqa: E402
from treespec_sglang.plugin import SGLANG_VERSION  # noqa: E402
from treespec_sglang.plugin.hooks import HOOKS, SIGNATURES  # noqa: E402

if sglang.__version__ != SGLANG_VERSION:
    pytest.skip(f"plugin pins sglang {SGLANG_VERSION}, found {sglang.__version__}", allow_module_level=True)


def test_entry_point_is_discovered():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="sglang.srt.plugins")}
    assert eps.get("treespec") == "treespec_sglang.plugin:register"


def test_every_hook_applies_without_failure(loaded):
    registry, records = loaded
    failed = [r.getMessage() for r in records if "Failed to apply hooks" in r.getMessage()]
    assert not failed, failed
    assert set(HOOKS) <= registry._patched


def test_hooked_signatures_match_what_the_hooks_assume(loaded):
    from pkgutil import resolve_name

    for target, expected in SIGNATURES.items():
        owner, attr = target.rsplit(".", 1)
        obj = resolve_name(owner)
        raw = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr)
        fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        params = list(inspect.signature(inspect.unwrap(fn)).parameters)
        assert params == expected, (target, params)


def test_the_graph_counters_targets_take_the_forward_batch_second():
    """``TREESPEC_GRAPH_LOG``'s targets exist in the installed sglang, each a method whose first parameter after
    ``self`` is the forward batch its counter reads the mode of."""
    from pkgutil import resolve_name

    from treespec_sglang.plugin.graph_log import RUNNERS

    for target in RUNNERS:
        owner, attr = target.rsplit(".", 1)
        params = list(inspect.signature(inspect.unwrap(getattr(resolve_name(owner), attr))).parameters)
        assert params[:2] == ["self", "forward_batch"], (target, params)


def test_a_rounds_result_has_the_graph_flag_the_round_hook_clears():
    """``hooks._eagle_round`` sets ``can_run_cuda_graph`` False on a round whose verify ran ragged: a field of the
    installed SGLang's round result, read by its batch result processor (the decode log, ``sglang:is_cuda_graph``)."""
    import dataclasses

    from sglang.srt.managers.scheduler_components import batch_result_processor
    from sglang.srt.managers.utils import GenerationBatchResult

    assert "can_run_cuda_graph" in {f.name for f in dataclasses.fields(GenerationBatchResult)}
    assert "result.can_run_cuda_graph" in inspect.getsource(batch_result_processor)


@pytest.mark.parametrize("topk,steps,N", [(3, 3, 8), (4, 4, 16), (2, 5, 9)])
def test_sglang_draft_functions_agree_with_our_eagle2(loaded, topk, steps, N):
    from treespec_sglang.policies import grow_tree

    draft = PathDraft(30, seed=topk + steps, sharpness=1.5)
    roots = torch.tensor([2, 9])
    (parent_list, top, toks), _ = sglang_draft_loop(draft, roots, topk, steps, N)
    ours = grow_tree([{"policy": "eagle2", "budget": N, "topk": topk, "depth": steps}] * 2, roots,
                     draft.root(roots), draft.expand)
    for b in range(2):
        parents = [-1]
        sel = top[b].tolist()
        for i in range(1, N):
            tb = sel[i - 1] // topk
            parents.append(0 if tb == 0 else sel.index(int(parent_list[b, tb])) + 1)
        assert ours.tokens[b].tolist() == [int(roots[b])] + toks[b].tolist()
        assert ours.parents[b].tolist() == parents


def test_custom_params_validate_on_real_sampling_params(loaded):
    from sglang.srt.sampling.sampling_params import SamplingParams

    from treespec_sglang.plugin import ServerDefaults, request_params

    ok = SamplingParams(max_new_tokens=8, custom_params={"treespec": {"policy": "salf", "budget": 60, "th": 0.6}})
    ok.verify(1000)
    assert request_params(ok, ServerDefaults()).th == 0.6
    bad = SamplingParams(max_new_tokens=8, custom_params={"treespec": {"policy": "talon", "mu": 3}})
    with pytest.raises(ValueError, match=r"custom_params\['treespec'\]: talon.mu must be in \[0.0, 1.0\], got 3"):
        bad.verify(1000)
    plain = SamplingParams(max_new_tokens=8)
    plain.verify(1000)  # untouched requests stay valid
    assert request_params(plain, ServerDefaults()) is None
    assert request_params(plain, ServerDefaults("talon", {"budget": 20})).budget == 20


def test_server_flags_are_added_and_exported(loaded, monkeypatch):
    import argparse

    from sglang.srt.server_args import ServerArgs

    from treespec_sglang.plugin.hooks import _from_cli_args

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "dummy", "--treespec-policy", "talon",
                              "--treespec-config", '{"budget": 30, "mu": 0.05}'])
    assert args.treespec_policy == "talon"
    for var in ("TREESPEC_POLICY", "TREESPEC_CONFIG"):  # restored (to unset) at teardown
        monkeypatch.setenv(var, "")
    _from_cli_args(None, ServerArgs, args)  # the AFTER hook on the parsed namespace
    assert os.environ["TREESPEC_POLICY"] == "talon"
    bad = parser.parse_args(["--model-path", "dummy", "--treespec-policy", "talon", "--treespec-config", '{"mu": 9}'])
    with pytest.raises(ValueError, match=r"talon.mu must be in"):
        _from_cli_args(None, ServerArgs, bad)
    from types import SimpleNamespace
    chain_server = SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=1)  # the built ServerArgs
    with pytest.raises(ValueError, match=r"--treespec-policy talon needs a draft tree"):  # at start, not per request
        _from_cli_args(chain_server, ServerArgs, args)


def test_token_cap_flag_is_added_validated_and_exported(loaded, monkeypatch):
    import argparse

    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    from treespec_sglang.plugin import server_defaults
    from treespec_sglang.plugin.hooks import _from_cli_args
    from treespec_sglang.plugin.request import request_shares

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for var in ("TREESPEC_POLICY", "TREESPEC_CONFIG", "TREESPEC_TOKEN_CAP"):
        monkeypatch.setenv(var, "")
    _from_cli_args(None, ServerArgs, parser.parse_args(["--model-path", "dummy", "--treespec-token-cap", "4"]))
    assert os.environ["TREESPEC_TOKEN_CAP"] == "4" and server_defaults().token_cap == 4
    assert not server_defaults().active  # a token cap alone sets no default policy
    with pytest.raises(ValueError, match=r"--treespec-token-cap must be an integer in \[1, 1024\]"):
        _from_cli_args(None, ServerArgs, parser.parse_args(["--model-path", "d", "--treespec-token-cap", "0"]))
    out = SamplingParams(max_new_tokens=8, custom_params={"treespec": {"policy": "talon", "token_cap": False}})
    out.verify(1000)
    assert not request_shares(out) and request_shares(SamplingParams(max_new_tokens=8))
    bad = SamplingParams(max_new_tokens=8, custom_params={"treespec": {"policy": "talon", "token_cap": 3}})
    with pytest.raises(ValueError, match=r"custom_params\['treespec'\]: token_cap must be true"):
        bad.verify(1000)


def test_a_malformed_batch_item_is_marked_not_raised(loaded):
    """The BEFORE hook on TokenizerManager._handle_batch_request marks bad items (also in the per-item
    objects GenerateReqInput already cached); validation passes them; the scheduler-side hook aborts
    exactly those requests with their message."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    from treespec_sglang.plugin import hooks
    from treespec_sglang.plugin.request import ERROR_KEY

    good = {"max_new_tokens": 4, "custom_params": {"treespec": {"policy": "talon", "budget": 8}}}
    bad = {"max_new_tokens": 4, "custom_params": {"treespec": {"policy": "talon", "budget": 0}}}
    obj = GenerateReqInput(input_ids=[[1, 2], [3, 4], [5, 6]], sampling_params=[good, bad, dict(good)])
    obj.normalize_batch_and_arguments()
    cached = obj[1]  # handed out before the hook runs (SGLang does this for rids)
    hooks._handle_batch_request(None, obj, None, {})
    assert bad["custom_params"].keys() == {"treespec"}  # the caller's dicts are not mutated
    flagged = [ERROR_KEY in (obj[i].sampling_params.get("custom_params") or {}) for i in range(3)]
    assert flagged == [False, True, False] and cached.sampling_params is obj.sampling_params[1]
    sp = SamplingParams(**obj[1].sampling_params)
    sp.verify(1000)  # marked: passes validation
    msg = obj[1].sampling_params["custom_params"][ERROR_KEY]
    assert "talon.budget must be in [1, 1024], got 0" in msg
    aborted = []
    req = SimpleNamespace(sampling_params=sp, set_finish_with_abort=lambda m, **kw: aborted.append((m, kw)))
    hooks._create_generation_req(req, None, None)
    assert aborted == [(msg, {"status_code": None, "err_type": "BadRequestError"})]
    ok = SimpleNamespace(sampling_params=SamplingParams(**obj[0].sampling_params),
                         set_finish_with_abort=lambda *a, **k: aborted.append("wrong"))
    hooks._create_generation_req(ok, None, None)
    assert len(aborted) == 1


def test_fuzzed_custom_params_through_the_real_hook(loaded):
    """Hypothesis-generated ``custom_params`` through SGLang's real ``SamplingParams.verify`` with the hook
    applied: a request is accepted with in-range params, or refused with ``ValueError`` naming the field."""
    hyp = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st
    from sglang.srt.sampling.sampling_params import SamplingParams

    from tests.policies.strategies import SPECS, check_valid
    from treespec_sglang.plugin import ServerDefaults, request_params

    @hyp.settings(max_examples=300, deadline=None)
    @hyp.given(st.one_of(SPECS.map(lambda s: {"treespec": s}), st.dictionaries(st.text(max_size=4), st.integers())))
    def run(custom):
        sp = SamplingParams(max_new_tokens=4, custom_params=custom)
        try:
            sp.verify(1000)
        except ValueError as e:
            assert str(e).startswith("custom_params['treespec']: "), e
            return
        p = request_params(sp, ServerDefaults())
        if p is not None:
            check_valid(p)

    run()
