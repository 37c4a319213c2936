"""The stand-ins' argument checks (:mod:`treespec_sglang.plugin.cpu.matcher`): SGLang's ``TensorMatcher`` rules and
messages, each refusal naming the op and the argument."""

import pytest
import torch

from treespec_sglang.plugin.cpu.matcher import Device, Matcher, Size, check


def test_a_symbol_binds_to_the_first_tensor_and_holds_the_rest_to_it():
    bs = Size("batch_size")
    m = Matcher("op", [bs, -1]).dtype(torch.int64)
    m.verify(torch.zeros(3, 5, dtype=torch.int64), "a")
    m.verify(torch.zeros(3, 5, dtype=torch.int64), "b")
    with pytest.raises(RuntimeError, match=r"op: c: Size mismatch for shape#0\('batch_size'\): expected 3 but got 2"):
        m.verify(torch.zeros(2, 5, dtype=torch.int64), "c")
    with pytest.raises(RuntimeError, match="op: d: Size mismatch for shape#1: expected 5 but got 4"):  # -1 bound too
        m.verify(torch.zeros(3, 4, dtype=torch.int64), "d")


def test_given_strides_replace_the_contiguity_rule_and_skip_bound_size_one_dims():
    col = torch.zeros(4, 9)[:, :3]  # strides (9, 1)
    Matcher("op", [4, 3]).strides([9, 1]).verify(col, "a")
    with pytest.raises(RuntimeError, match="not contiguous"):
        Matcher("op", [4, 3]).verify(col, "a")
    one_row = torch.zeros(1, 9)[:, :3]  # size-1 dim: its (bound) stride is not checked, as in TensorMatcher
    Matcher("op", [1, 3]).strides([3, 1]).verify(one_row, "a")
    with pytest.raises(RuntimeError, match="stride#0"):
        Matcher("op", [4, 3]).strides([3, 1]).verify(col, "a")


def test_a_device_symbol_wants_one_device_of_its_kind():
    dev = Device("cpu")
    m = Matcher("op", [-1]).device(dev)
    m.verify(torch.zeros(2), "a")
    with pytest.raises(RuntimeError, match="a: Device mismatch: expected cpu but got meta"):
        Matcher("op", [-1]).device(Device("cpu")).verify(torch.zeros(2, device="meta"), "a")
    with pytest.raises(RuntimeError, match="dimension mismatch: expected 1 but got 2"):
        m.verify(torch.zeros(2, 2), "b")


def refusal(fn) -> str:
    with pytest.raises(RuntimeError) as refused:
        fn()
    return str(refused.value)


def test_each_refusal_names_the_op_the_argument_and_the_rule():
    m = Matcher("op", [2, -1]).dtype(torch.int32, torch.int64)
    assert refusal(lambda: m.verify([1, 2], "a")) == "op: a: expected a tensor, got list"
    assert refusal(lambda: m.verify(torch.zeros(2, dtype=torch.int64), "b")) == \
        "op: b: Tensor dimension mismatch: expected 2 but got 1"
    assert refusal(lambda: m.verify(torch.zeros(2, 3), "c")) == \
        "op: c: dtype mismatch: expected int32 or int64 but got float32"
    assert refusal(lambda: check("op", False, "what went wrong")) == "op: what went wrong"
    check("op", True, "never raised")


def test_an_unbound_symbol_has_no_value_and_strides_need_one_per_dimension():
    assert refusal(lambda: Size("vocab_size").unwrap()) == "Size value is not set (vocab_size)"
    with pytest.raises(ValueError, match="^strides size must match shape size$"):
        Matcher("op", [2, 3]).strides([3])


def test_a_device_symbol_is_a_cpu_one_unless_told_and_binds_the_first_device():
    dev = Device()
    assert dev.kind == "cpu" and dev.value is None
    assert dev.verify(torch.device("cpu")) is None and dev.value == torch.device("cpu")
    assert dev.verify(torch.device("cpu", 0)) == "Device mismatch: expected cpu but got cpu:0"  # bound: the same one
    assert Device("cuda").verify(torch.device("cpu")) == "Device mismatch: expected cuda but got cpu"
