"""Building a :class:`SpecEngine` by hand: what the constructor does to the models it is given (dtype, fused
linears, the draft's shared embedding), the EOS ids, the attributes that live in its model calls, the token
map's rules for an EAGLE-3 head, and the cost curve measured once per batch size."""

import dataclasses

import pytest
import torch

from tests.engines import ChatTokenizer, Tokenizer
from tests.models.tiny import make_tiny_llama
from treespec_sglang.engine import SpecEngine
from treespec_sglang.models import Eagle3DraftHead, EagleDraftHead, LlamaModel

pytest.importorskip("transformers")

VOCAB = 48
HOT = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:32]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-build")
    make_tiny_llama(path, vocab=VOCAB, hidden=32, layers=4, heads=4, kv_heads=2, seed=3)
    return str(path)


def build(path, head="eagle", **kw):
    target = LlamaModel.from_pretrained(path)
    if head == "eagle":
        draft = EagleDraftHead.for_target(target.config)
    else:
        draft = Eagle3DraftHead.for_target(target.config, HOT, target.lm_head.weight, target.model.norm.weight)
    return SpecEngine(target, draft, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_constructor_casts_fuses_and_attaches(tiny, dtype):
    e = build(tiny, dtype=dtype)
    assert {p.dtype for p in e.target.parameters()} == {dtype} and {p.dtype for p in e.draft.parameters()} == {dtype}
    assert e.dtype == dtype and e.device == torch.device("cpu") and not e.target.training and not e.draft.training
    assert (e.calls.dtype, e.calls.device) == (dtype, torch.device("cpu"))  # what the stages allocate with
    attn = e.target.model.layers[0].self_attn
    assert hasattr(attn, "qkv_proj") and not hasattr(attn, "q_proj")  # fused by default
    assert e.draft.embed is e.target.model.embed_tokens  # the draft reads the target's embedding
    assert e.dtype_note.startswith("float32" if dtype == torch.float32 else "bfloat16")
    plain = build(tiny, fuse=False, dtype_note="float32 (given)")
    assert hasattr(plain.target.model.layers[0].self_attn, "q_proj") and plain.dtype_note == "float32 (given)"
    with pytest.raises(ValueError, match=r"^pack=True needs fuse=True \(fuse=False keeps plain trainable modules\)$"):
        build(tiny, fuse=False, pack=True)


def test_eos_ids_are_the_config_s_and_the_tokenizer_s(tiny):
    cfg_eos = set(LlamaModel.from_pretrained(tiny).config.eos_ids)
    assert build(tiny).eos == cfg_eos
    assert build(tiny, tokenizer=Tokenizer(None)).eos == cfg_eos
    assert build(tiny, tokenizer=Tokenizer(7)).eos == cfg_eos | {7}


def test_models_and_tokenizer_live_in_the_model_calls(tiny):
    e = build(tiny, tokenizer=Tokenizer(None))
    assert e.target is e.calls.target and e.draft is e.calls.draft and e.tokenizer is e.calls.tokenizer
    tok = Tokenizer(3)
    e.tokenizer = tok
    assert e.calls.tokenizer is tok
    e.draft = e.calls.draft
    e.target = target = e.calls.target
    assert e.calls.target is target and e.calls.token_map is None and e.calls.draft_head is e.target.lm_head
    with pytest.raises(AttributeError, match=r"^SpecEngine\.token_map is read-only: set it with set_token_map$"):
        e.token_map = HOT  # set_token_map checks and builds the head: the only way in
    assert e.token_map is None
    assert SpecEngine.target.__doc__ == "The target model." and "set_token_map" in SpecEngine.token_map.__doc__
    assert SpecEngine.tokenizer.__doc__.startswith("The target's tokenizer") and SpecEngine.draft.name == "draft"


def test_a_read_only_model_call_names_its_own_setter():
    """The read-only message names the method that sets the attribute, not one method for every attribute."""
    from types import SimpleNamespace

    from treespec_sglang.engine.engine import _InCalls

    class Holder:
        head = _InCalls("A head.", setter="set_head")
        note = _InCalls("A note.")

    h = Holder()
    h.calls = SimpleNamespace(head=1, note=2)
    with pytest.raises(AttributeError, match=r"^SpecEngine\.head is read-only: set it with set_head$"):
        h.head = 3
    h.note = 4
    assert (h.head, h.note, h.calls.note) == (1, 4, 4)


def test_a_one_id_token_map(tiny):
    e = build(tiny)
    e.set_token_map(torch.tensor([5]))
    assert e.draft_vocab == 1 and e.calls.draft_head.weight.shape == (1, 32)
    torch.testing.assert_close(e.calls.draft_head.weight[0], e.target.lm_head.weight[5], rtol=0, atol=0)
    assert e.calls.draft_head.bias is None and not e.calls.draft_head.weight.requires_grad
    # draft id 0 -> target 5; the root (a target id already) and padding stay as they are
    mapped = e.calls.to_target_ids(torch.tensor([[9, 0, -1]]), torch.tensor([[True, False, False]]))
    assert mapped.tolist() == [[9, 5, -1]]


def test_an_eagle3_head_keeps_its_own_draft_vocabulary(tiny):
    e = build(tiny, head="eagle3", fuse=False)
    assert torch.equal(e.token_map, HOT) and e.calls.draft_head == e.draft.logits and e.draft_vocab == 32
    e.set_token_map(HOT.tolist())  # exactly the head's: accepted
    e.set_token_map(None)  # no map: the head's
    assert torch.equal(e.token_map, HOT)
    msg = (r"^token_map: an EAGLE-3 head carries its own draft vocabulary \(d2t\); "
           r"pass no token map, or exactly the head's$")
    with pytest.raises(ValueError, match=msg):
        e.set_token_map(HOT.flip(0))
    assert torch.equal(e.token_map, HOT)


def test_the_cost_curve_is_measured_once_per_batch_size(tiny, monkeypatch):
    from treespec_sglang.engine import cost
    from treespec_sglang.models import demo

    calls = []

    def fake(engine, cache_dir, model_id, bs=1):
        calls.append((engine, cache_dir, model_id, bs))
        return (f"curve {bs}", bs == 4)

    monkeypatch.setattr(cost, "measure_cost_curve", fake)
    e = build(tiny)
    assert e.measured_cost_curve() == ("curve 1", False) and e.cost_curve == "curve 1"
    assert e.measured_cost_curve(4) == ("curve 4", True) and e.measured_cost_curve(4) == ("curve 4", True)
    assert e.measured_cost_curve() == ("curve 1", False)
    here = demo.cache_dir()  # the curves are cached on disk beside the demo's files
    assert calls == [(e, here, str(e.target.config), 1), (e, here, str(e.target.config), 4)]


def test_a_new_engine_has_no_calibration_and_uses_an_assigned_cost_curve(tiny, monkeypatch):
    from treespec_sglang.engine import cost

    monkeypatch.setattr(cost, "measure_cost_curve", lambda *a, **k: pytest.fail("measured an assigned curve"))
    e = build(tiny)
    assert e.calibration is None and e.cost_curve is None and e.observer is None
    e.cost_curve = "mine"
    assert e.measured_cost_curve() == ("mine", False)  # used as it is, and not from the disk


def test_text_goes_through_the_chat_template_by_default(tiny):
    e = build(tiny, tokenizer=ChatTokenizer())
    assert e.encode(["abc", [4, 5]]) == [[1, 2, 3], [4, 5]] == e.calls.encode(["abc", [4, 5]])
    assert e.encode(["abc"], chat=False) == [[3]] == e.calls.encode(["abc"], False)
    with pytest.raises(ValueError, match=r"^prompt 1 is empty \(0 tokens\)$"):
        e.encode(["a", ""], chat=False)


def test_an_eagle3_head_reads_the_target_layers_it_names(tiny):
    """The target returns the residual streams the head names (SGLang's default capture points where it names
    none); a head built for another target's width or naming a layer the target lacks is refused by name."""
    from treespec_sglang.models.eagle3_head import default_aux_layers

    def engine(aux, cfg=None):
        target = LlamaModel.from_pretrained(tiny)
        head = Eagle3DraftHead.for_target(cfg or target.config, HOT)
        head.aux_layers = aux
        return SpecEngine(target, head, fuse=False)

    e = engine(None)
    assert e.draft.aux_layers == default_aux_layers(4) == (2, 2, 1) and e.target.aux_layers == (2, 2, 1)
    for aux in ((0, 1, 3), (0, 1, 2)):
        assert engine(aux).target.aux_layers == aux
    msg = r"^EAGLE-3 head reads 3 x 32 features from layers \(0, 1, 4\); the target has hidden 32 and 4 layers$"
    with pytest.raises(ValueError, match=msg):
        engine((0, 1, 4))
    with pytest.raises(ValueError, match=r"^EAGLE-3 head reads 2 x 32 features from layers \(0, 1\)"):
        engine((0, 1))  # two layers named, its fc built for three
    wide = dataclasses.replace(LlamaModel.from_pretrained(tiny).config, hidden_size=48)
    with pytest.raises(ValueError, match=r"^EAGLE-3 head reads 3 x 48 features from layers"):
        engine(None, wide)


def test_from_pretrained_loads_resolves_the_dtype_and_builds(tiny, monkeypatch):
    """from_pretrained passes its target, draft, resolved dtype and seed to the loader and builds the engine
    with the loader's tokenizer and token map, its device, fuse and pack options and the dtype's note; the
    defaults: the demo target, a seeded random head, dtype "auto", seed 0, fused, pack where the probe passes."""
    from treespec_sglang.engine import engine as E
    from treespec_sglang.engine.dtypes import explain_dtype, resolve_dtype

    loads, packs, tok = [], [], Tokenizer(None)
    real_pack = E.resolve_pack

    def load(target, draft, dtype, seed):
        loads.append((target, draft, dtype, seed))
        t = LlamaModel.from_pretrained(tiny)
        return t, EagleDraftHead.for_target(t.config), tok, torch.tensor([4, 6])

    def resolve_pack(pack, dtype, device):
        packs.append((pack, dtype, str(device)))
        return real_pack(pack, dtype, device)

    monkeypatch.setattr(E, "load_models", load)
    monkeypatch.setattr(E, "resolve_pack", resolve_pack)
    auto = resolve_dtype("auto", "cpu")
    e = SpecEngine.from_pretrained()
    assert loads == [("smollm2-135m", None, auto, 0)] and packs == [(None, auto, "cpu")]
    assert e.tokenizer is tok and e.token_map.tolist() == [4, 6] and e.dtype == auto and e.device.type == "cpu"
    assert e.dtype_note == explain_dtype("auto", "cpu") and hasattr(e.target.model.layers[0].self_attn, "qkv_proj")
    e = SpecEngine.from_pretrained("other", draft="demo", device="cpu", dtype="float32", seed=3, pack=False)
    assert loads[-1] == ("other", "demo", torch.float32, 3) and packs[-1] == (False, torch.float32, "cpu")
    assert e.dtype_note == explain_dtype("float32", "cpu") and not e.packed
    e = SpecEngine.from_pretrained(fuse=False)  # plain trainable modules: never packed
    assert packs[-1] == (False, auto, "cpu") and hasattr(e.target.model.layers[0].self_attn, "q_proj")


def test_a_token_map_head_is_packed_exactly_when_the_engine_is(tiny, monkeypatch):
    """The token map's head is an int64 map's rows of the target's LM head: a plain linear in an engine that
    does not pack, a PackedLinear in one that does (oneDNN's probe forced here: any CPU runs both branches)."""
    from treespec_sglang.engine import engine as E

    plain = build(tiny, pack=False)
    plain.set_token_map(torch.tensor([5, 7], dtype=torch.int32))
    assert plain.token_map.dtype == torch.int64 and plain.token_map.tolist() == [5, 7]
    assert type(plain.calls.draft_head) is torch.nn.Linear

    class Packed:  # stands in for PackedLinear
        def __init__(self, lin):
            self.lin = lin

    monkeypatch.setattr(E, "resolve_pack", lambda pack, dtype, device: (True, "forced"))
    monkeypatch.setattr(E, "pack_linears_", lambda module: None)
    monkeypatch.setattr(E, "PackedLinear", Packed)
    packed = build(tiny)
    packed.set_token_map(torch.tensor([3, 9]))
    assert packed.packed and isinstance(packed.calls.draft_head, Packed)
    torch.testing.assert_close(packed.calls.draft_head.lin.weight, packed.target.lm_head.weight[[3, 9]], rtol=0, atol=0)
