"""The benchmark matrix: server settings, per-request policy dicts sized to the server, cells, bad input."""

import json
import re

import pytest

from treespec_sglang.policies.base import parse_spec
from treespec_sglang.serverbench.matrix import Cell, ServerSetting, build_matrix, parse_servers, policy_spec


def test_parse_servers_keeps_order_and_drops_duplicates():
    got = parse_servers(" plain , eagle:4/3/8,eagle:1/3/4, eagle:4/3/8")
    assert [s.label for s in got] == ["plain", "eagle(k4,s3,N8)", "eagle(k1,s3,N4)"]
    assert got[1].launch_args() == ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4",
                                    "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "8"]
    assert got[0].launch_args() == []


@pytest.mark.parametrize("text, message", [
    ("eagle:4/3", "'plain' or 'eagle:TOPK/STEPS/N'"),
    ("medusa", "'plain' or 'eagle:TOPK/STEPS/N'"),
    ("eagle:0/3/8", "topk must be an integer >= 1, got 0"),
    ("eagle:4/3/1", "N must be an integer >= 2, got 1"),
    ("eagle:1/3/8", "topk 1 (chain) needs N = steps + 1 = 4, got 8"),
    ("", "at least one"),
])
def test_bad_server_items_name_the_field(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_servers(text)


@pytest.mark.parametrize("name", ["eagle2", "talon", "salf", "c2t", "chain"])
@pytest.mark.parametrize("budget", [1, 5, 8])
def test_every_policy_spec_is_a_valid_request_param_within_the_server(name, budget):
    server = ServerSetting("EAGLE", 4, 3, 8)
    spec = policy_spec(name, budget, server)
    params = parse_spec(spec)  # the request validation the plugin runs accepts it
    assert spec["policy"] == name
    if name == "chain":
        assert 1 <= spec["length"] <= 3 and spec["length"] <= max(1, budget - 1)
    else:
        assert spec["budget"] == budget
    if "topk" in spec:
        assert spec["topk"] == 4
    assert type(params).__name__.lower().startswith(name)


def test_policy_json_overrides_one_policy_only():
    server = ServerSetting("EAGLE", 4, 3, 8)
    extra = {"talon": {"mu": 0.1}}
    assert policy_spec("talon", 8, server, extra)["mu"] == 0.1
    assert policy_spec("c2t", 8, server, extra) == policy_spec("c2t", 8, server)


def test_matrix_has_native_and_plain_rows_and_skips_budgets_above_n():
    servers = parse_servers("plain,eagle:4/3/8")
    cells = build_matrix(servers, ["talon", "c2t"], ["4", "N", "16", "8"], [1, 4], [0.0, 1.0])
    plain = [c for c in cells if c.server.algorithm == "none"]
    eagle = [c for c in cells if c.server.algorithm == "EAGLE"]
    assert [c.policy_label for c in plain] == ["plain"] * 4  # 2 concurrency x 2 T, no policies
    labels = sorted({c.policy_label for c in eagle})
    assert labels == ["c2t(b4)", "c2t(b8)", "native", "talon(b4)", "talon(b8)"]  # 16 > N skipped, N == 8 once
    assert len(eagle) == 5 * 2 * 2
    assert len({c.label for c in cells}) == len(cells)
    assert cells.index(plain[-1]) < cells.index(eagle[0])  # grouped by server: one start each
    spec = next(c for c in eagle if c.policy_label == "talon(b4)").spec
    assert spec == json.loads(json.dumps(policy_spec("talon", 4, servers[1])))


@pytest.mark.parametrize("kw, message", [
    (dict(concurrency=0, temperature=0.0), "--concurrency values must be integers >= 1, got 0"),
    (dict(concurrency=1, temperature=-1.0), r"--temperatures values must be in \[0, 100\], got -1.0"),
])
def test_bad_cells_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        Cell(ServerSetting("none"), None, None, **kw)


def test_bad_budget_and_policy_name_the_field():
    s = parse_servers("eagle:4/3/8")
    with pytest.raises(ValueError, match="--budgets: each value must be an integer >= 1 or 'N', got 'x'"):
        build_matrix(s, ["talon"], ["x"], [1], [0.0])
    with pytest.raises(ValueError, match="--budgets: each value must be an integer >= 1 or 'N', got '0'"):
        build_matrix(s, ["talon"], ["0"], [1], [0.0])
    with pytest.raises(ValueError, match="--policies: each must be one of"):
        build_matrix(s, ["medusa"], ["N"], [1], [0.0])


def test_the_launch_command_follows_the_drafts_architecture(tmp_path):
    """An EAGLE-3 draft directory starts its server with --speculative-algorithm EAGLE3 (served as EAGLE it
    would accept nothing); an EAGLE one with EAGLE plus its token map; plain servers get no draft."""
    from treespec_sglang.models import Eagle3DraftHead, EagleDraftHead, LlamaConfig
    from treespec_sglang.serverbench.server import launch_command

    cfg = LlamaConfig.from_dict({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 8,
                                 "num_attention_heads": 4, "num_key_value_heads": 2})
    Eagle3DraftHead.for_target(cfg, list(range(16))).save(str(tmp_path / "e3"))
    EagleDraftHead.for_target(cfg).save(str(tmp_path / "e1"))
    eagle = parse_servers("eagle:4/3/8")[0]

    def flag(argv, name):
        return argv[argv.index(name) + 1] if name in argv else None

    argv = launch_command("m", eagle, draft=str(tmp_path / "e3"), token_map=None, device="cpu", port=1)
    assert flag(argv, "--speculative-algorithm") == "EAGLE3" and flag(argv, "--speculative-eagle-topk") == "4"
    argv = launch_command("m", eagle, draft=str(tmp_path / "e1"), token_map="tm.pt", device="cpu", port=1)
    assert flag(argv, "--speculative-algorithm") == "EAGLE" and flag(argv, "--speculative-token-map") == "tm.pt"
    argv = launch_command("m", parse_servers("plain")[0], draft=str(tmp_path / "e3"), token_map=None, device="cpu",
                          port=1)
    assert "--speculative-algorithm" not in argv and "--speculative-draft-model-path" not in argv
