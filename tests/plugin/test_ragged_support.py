"""``plugin.ragged_support``: where ragged verify applies: the setting read from the environment (a bad value
refused, never read as auto), the backends it has a path for (by class name along the MRO), attention data
parallelism and the target models it refuses (at start when asked for explicitly, padded under auto)."""

import re
from types import SimpleNamespace

import pytest

from treespec_sglang.plugin.ragged_support import (ENV_RAGGED, check_ragged_model, check_ragged_parallelism,
                                                   ragged_mode, ragged_tuned, ragged_unsupported)


class IntelAMXAttnBackend:  # stand-ins named like SGLang's backends (ragged_mode reads the class name)
    pass


class FlashInferAttnBackend:
    pass


class TritonAttnBackend:
    pass


@pytest.mark.parametrize("env, backend, want", [
    (None, IntelAMXAttnBackend, "cpu"), (None, FlashInferAttnBackend, None), ("1", FlashInferAttnBackend, "flashinfer"),
    ("0", IntelAMXAttnBackend, None), ("1", TritonAttnBackend, None), ("auto", IntelAMXAttnBackend, "cpu")])
def test_ragged_mode_by_backend_and_env(monkeypatch, env, backend, want):
    if env is None:
        monkeypatch.delenv(ENV_RAGGED, raising=False)
    else:
        monkeypatch.setenv(ENV_RAGGED, env)
    assert ragged_mode(SimpleNamespace(attn_backend=backend())) == want


@pytest.mark.parametrize("env, mode, want", [
    (None, "cpu", True), ("auto", "cpu", True), (" Auto ", "cpu", True),  # the CPU's default: timed, never slower
    ("tuned", "cpu", True), ("tuned", "flashinfer", True),
    ("1", "cpu", False), ("on", "flashinfer", False),  # every compactable verify ragged
    ("auto", "flashinfer", False)])  # (no ragged FlashInfer path under auto: ragged_mode is None there)
def test_which_ragged_verifies_are_tuned(monkeypatch, env, mode, want):
    monkeypatch.delenv(ENV_RAGGED, raising=False) if env is None else monkeypatch.setenv(ENV_RAGGED, env)
    assert ragged_tuned(mode) is want


@pytest.mark.parametrize("env, want", [(" OFF ", None), ("False", None), ("On", "flashinfer"), ("YES", "flashinfer")])
def test_ragged_mode_reads_the_env_case_insensitively(monkeypatch, env, want):
    monkeypatch.setenv(ENV_RAGGED, env)
    backend = IntelAMXAttnBackend if want is None else FlashInferAttnBackend
    assert ragged_mode(SimpleNamespace(attn_backend=backend())) == want


@pytest.mark.parametrize("env", ["2", "flashinfer", "maybe"])
def test_a_bad_ragged_setting_is_refused_not_read_as_auto(monkeypatch, env):
    monkeypatch.setenv(ENV_RAGGED, env)
    with pytest.raises(ValueError, match=r"TREESPEC_RAGGED_VERIFY must be one of 1 / 0 .* / auto / tuned, got"):
        ragged_mode(SimpleNamespace(attn_backend=IntelAMXAttnBackend()))


def test_ragged_mode_of_a_runner_without_an_attention_backend_is_none(monkeypatch):
    monkeypatch.setenv(ENV_RAGGED, "1")
    assert ragged_mode(SimpleNamespace()) is None


DP_ATTENTION = [SimpleNamespace(enable_dp_attention=True), SimpleNamespace(enable_dp_attention=False, attn_dp_size=2)]


@pytest.mark.parametrize("server_args", DP_ATTENTION)
@pytest.mark.parametrize("env", ["1", "tuned"])
def test_an_explicit_ragged_verify_is_refused_under_attention_data_parallelism(monkeypatch, env, server_args):
    monkeypatch.setenv(ENV_RAGGED, env)
    with pytest.raises(ValueError, match=rf"^treespec: TREESPEC_RAGGED_VERIFY={env} cannot run with attention data "
                       r"parallelism \(--enable-dp-attention\): every DP group verifies bs \* N tokens there; unset it "
                       r"\(auto: padded under DP attention\) or set 0$"):
        check_ragged_parallelism(server_args)


@pytest.mark.parametrize("env", [None, "0"])
def test_auto_and_off_start_under_attention_data_parallelism_and_verify_padded(monkeypatch, env):
    monkeypatch.delenv(ENV_RAGGED, raising=False) if env is None else monkeypatch.setenv(ENV_RAGGED, env)
    for server_args in DP_ATTENTION:
        check_ragged_parallelism(server_args)
        runner = SimpleNamespace(attn_backend=IntelAMXAttnBackend(), server_args=server_args)
        assert ragged_mode(runner) is None
    plain = SimpleNamespace(enable_dp_attention=False, attn_dp_size=1)  # DP without DP attention: as before
    check_ragged_parallelism(plain)
    assert ragged_mode(SimpleNamespace(attn_backend=IntelAMXAttnBackend(), server_args=plain)) == (
        None if env == "0" else "cpu")
    monkeypatch.setenv(ENV_RAGGED, "tuned")
    check_ragged_parallelism(plain)


class TRTLLMHAAttnBackend(FlashInferAttnBackend):  # SGLang's TRT-LLM backend derives from FlashInfer's ...
    __module__ = "sglang.srt.layers.attention.trtllm_mha_backend"  # ... and builds its own verify metadata


class MyFlashInfer(FlashInferAttnBackend):  # an operator's subclass outside SGLang keeps FlashInfer's verify
    pass


@pytest.mark.parametrize("backend,want", [(FlashInferAttnBackend, "flashinfer"), (MyFlashInfer, "flashinfer"),
                                          (TRTLLMHAAttnBackend, None), (IntelAMXAttnBackend, "cpu")])
def test_only_the_backends_whose_verify_arguments_are_compacted_run_ragged(monkeypatch, backend, want):
    monkeypatch.setenv(ENV_RAGGED, "1")
    assert ragged_mode(SimpleNamespace(attn_backend=backend())) == want


UNSUPPORTED = [(dict(sliding_window_size=4096), "a sliding-window attention model"),
               (dict(model_config=SimpleNamespace(is_encoder_decoder=True)),
                "an encoder-decoder model (cross attention)"),
               (dict(model_config=SimpleNamespace(model_is_mrope=True)),
                "a model with multimodal rotary positions (mrope)"),
               (dict(server_args=SimpleNamespace(enable_lora=True)), "LoRA adapters (--enable-lora / --lora-paths)"),
               (dict(server_args=SimpleNamespace(lora_paths=["a=/x"])), "LoRA adapters (--enable-lora / --lora-paths)"),
               (dict(server_args=SimpleNamespace(ep_size=2)), "expert parallelism (--ep-size 2)"),
               (dict(server_args=SimpleNamespace(enable_return_routed_experts=True)),
                "routed experts returned (--enable-return-routed-experts)")]


@pytest.mark.parametrize("runner,reason", UNSUPPORTED)
@pytest.mark.parametrize("env", ["1", "tuned", None])
def test_a_target_with_more_per_token_verify_state_never_runs_ragged(monkeypatch, runner, reason, env):
    """1 / tuned: refused at start, naming the variable and why; auto: such a target verifies padded."""
    monkeypatch.delenv(ENV_RAGGED, raising=False) if env is None else monkeypatch.setenv(ENV_RAGGED, env)
    backend = IntelAMXAttnBackend if env is None else FlashInferAttnBackend
    if env is None:
        check_ragged_model(SimpleNamespace(**runner))
    else:
        with pytest.raises(ValueError, match=rf"^treespec: TREESPEC_RAGGED_VERIFY={env} cannot verify ragged with "
                           rf"{re.escape(reason)}; unset it \(auto: padded verify for this model\) or set 0$"):
            check_ragged_model(SimpleNamespace(**runner))
    assert ragged_unsupported(SimpleNamespace(**runner)) == reason
    assert ragged_mode(SimpleNamespace(attn_backend=backend(), **runner)) is None
    plain = dict(sliding_window_size=None, model_config=SimpleNamespace(is_encoder_decoder=False, model_is_mrope=False),
                 server_args=SimpleNamespace(enable_lora=False, lora_paths=None, ep_size=1,
                                             enable_return_routed_experts=False))
    check_ragged_model(SimpleNamespace(**plain))
    assert ragged_mode(SimpleNamespace(attn_backend=backend(), **plain)) == ("cpu" if env is None else "flashinfer")


def test_a_runners_target_is_judged_once(monkeypatch):
    """ragged_mode asks :func:`ragged_unsupported` once per runner and keeps the verdict on it (every verify asks):
    a runner judged supported stays so, one judged unsupported stays padded."""
    from treespec_sglang.plugin import ragged_support

    monkeypatch.setenv(ENV_RAGGED, "1")
    asked = []
    monkeypatch.setattr(ragged_support, "ragged_unsupported", lambda r: asked.append(r) or r.verdict)
    ok = SimpleNamespace(attn_backend=FlashInferAttnBackend(), verdict=None)
    bad = SimpleNamespace(attn_backend=FlashInferAttnBackend(), verdict="a sliding-window attention model")
    for _ in range(3):
        assert ragged_mode(ok) == "flashinfer" and ragged_mode(bad) is None
    assert asked == [ok, bad]
    assert ok._treespec_ragged_unsupported is False and bad._treespec_ragged_unsupported is True
