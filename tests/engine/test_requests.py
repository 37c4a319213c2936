"""Admission (``engine/requests.py``): a ``generate`` call's prompts and policy dicts -> the requests that run,
each refused one with its error and its policy's name kept; and the prompt encoder it calls
(``ModelCalls.encode_one``): the chat template, a tokenizer without one, ids at the vocabulary's edge."""

from types import SimpleNamespace

import pytest
import torch

from tests.engines import ChatTokenizer, Tokenizer
from treespec_sglang.engine.calls import ModelCalls
from treespec_sglang.engine.options import GenerateOptions
from treespec_sglang.engine.requests import PLAIN, admit
from treespec_sglang.policies import parse_spec

VOCAB = 64


def engine(tokenizer=None, **config):
    """What :func:`admit` reads of an engine: the target's config and the model calls' encoder (no model)."""
    target = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB, **config))
    calls = ModelCalls(target, None, None, None, tokenizer, torch.device("cpu"), torch.float32)
    return SimpleNamespace(target=target, calls=calls)


class TextTokenizer(Tokenizer):
    """Text -> ``[len(text)]``, and no chat template at all (no attribute)."""

    def __init__(self):
        super().__init__(None)

    def __call__(self, text):
        return {"input_ids": [len(text)]}


class DictChatTokenizer(ChatTokenizer):
    """A chat template that returns a mapping (``BatchEncoding``) rather than a list of ids."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return {"input_ids": super().apply_chat_template(messages, add_generation_prompt, tokenize)}


def test_one_text_prompt_is_one_request_not_one_per_character():
    a = admit(engine(ChatTokenizer()), "abcd", None, GenerateOptions(4))
    assert a.ids == [[1, 2, 4]] and a.ok == [0] and len(a.results) == 1 and a.plain
    assert a.params == [parse_spec(PLAIN)] and a.shares == [True]


def test_the_chat_option_reaches_the_encoder():
    e = engine(ChatTokenizer())
    assert admit(e, ["abc", [7, 8]], None, GenerateOptions(4)).ids == [[1, 2, 3], [7, 8]]
    assert admit(e, ["abc", [7, 8]], None, GenerateOptions(4, chat=False)).ids == [[3], [7, 8]]


@pytest.mark.parametrize("tokenizer", [TextTokenizer(), DictChatTokenizer()])
def test_text_without_a_chat_template_or_with_a_mapping_one(tokenizer):
    """A tokenizer with no ``chat_template`` attribute encodes the text as it is; a template that returns a
    mapping gives its ``input_ids``."""
    want = [5] if isinstance(tokenizer, TextTokenizer) else [1, 2, 5]
    assert engine(tokenizer).calls.encode_one(0, "hello", True) == want


def test_ids_must_lie_inside_the_vocabulary():
    calls = engine().calls
    assert calls.encode_one(0, [0, VOCAB - 1], False) == [0, VOCAB - 1]
    for bad in ([VOCAB], [-1, 3], []):
        with pytest.raises(ValueError, match=rf"^prompt 2: token ids must be non-empty and in \[0, {VOCAB - 1}\]$"):
            calls.encode_one(2, bad, False)


@pytest.mark.parametrize("length, admitted", [(12, True), (13, False)])
def test_a_prompt_that_fills_the_context_exactly_is_admitted(length, admitted):
    """prompt + max_new_tokens may equal max_position_embeddings (16 here), not exceed it."""
    a = admit(engine(max_position_embeddings=16), [[1] * length, [2]], None, GenerateOptions(4))
    assert a.ok == ([0, 1] if admitted else [1])
    if not admitted:
        assert a.results[0].error == ("request 0: prompt 0 has 13 tokens; with max_new_tokens 4 that is 17 > the "
                                      "model's context 16 (max_position_embeddings): shorten the prompt or "
                                      "max_new_tokens") and a.results[0].token_ids == []


def test_a_config_without_a_context_length_bounds_nothing():
    a = admit(engine(), [[1] * 5000], None, GenerateOptions(4000))
    assert a.ok == [0] and a.results[0].error is None


def test_each_result_names_its_policy_whether_it_runs_or_not():
    specs = [{"policy": "talon", "budget": 8}, None, {"policy": "eagle2", "topk": 99}, {"policy": "chain"}, "talon",
             {}]
    a = admit(engine(), [[1], [2], [3], [4], [5], [6]], specs, GenerateOptions(4))
    assert [r.stats.policy for r in a.results] == ["talon", None, "eagle2", "chain", None, None]
    assert a.ok == [0, 1, 3] and not a.plain  # eagle2's topk, a string and an empty dict are refused
    assert a.results[2].error.startswith("request 2: eagle2.topk") and a.results[4].error.startswith("request 4: ")
    assert a.params[1] == parse_spec(PLAIN)  # None runs plain rounds beside the others


def test_a_policy_list_of_the_wrong_length_is_refused_whole():
    with pytest.raises(ValueError, match=r"^policy must be one dict or a list of 2 \(one per prompt\), got 3$"):
        admit(engine(), [[1], [2]], [None, None, None], GenerateOptions(4))
