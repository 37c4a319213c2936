"""The stand-in for the Triton kernel SGLang's overlap scheduler calls (:mod:`treespec_sglang.plugin.cpu.overlap`):
its results against plain row loops (the Triton kernel itself: ``test_kernels.py``, by the interpreter), what it
refuses, and where the plugin installs it."""

import re

import pytest
import torch

from tests.plugin.cpu.standin_args import meta, strided
from treespec_sglang import plugin
from treespec_sglang.plugin import cpu, hooks
from treespec_sglang.plugin.cpu.overlap import gather_spec_extras


def bufs(rows=5, k=3, hidden=4):
    g = torch.Generator().manual_seed(rows * 10 + k)
    return (torch.rand(rows, k, generator=g), torch.randint(0, 99, (rows, k), generator=g),
            torch.randint(0, 99, (rows,), generator=g), None if hidden is None else torch.randn(rows, hidden, 2))


@pytest.mark.parametrize("hidden", [4, None])
@pytest.mark.parametrize("index", [[3, 0, 3, 4], [], [2]])
def test_rows_are_gathered_into_new_tensors_of_each_dtype(hidden, index):
    src = bufs(hidden=hidden)
    idx = torch.tensor(index, dtype=torch.int32)
    out = gather_spec_extras(idx, *src)
    for got, buf in zip(out, src):
        if buf is None:
            assert got is None
            continue
        assert got.dtype == buf.dtype and got.shape == (len(index), *buf.shape[1:])
        for r, i in enumerate(index):
            assert torch.equal(got[r], buf[i])
        if index:
            got.zero_()  # a copy: the future map's buffer keeps its rows
            assert bool((buf[index[0]] != 0).any())


def test_a_strided_index_is_taken_as_the_kernels_wrapper_takes_it():
    src = bufs()
    idx = torch.tensor([4, 9, 1, 9, 0, 9])[::2]  # [4, 1, 0], not contiguous
    assert torch.equal(gather_spec_extras(idx, *src)[1], src[1][[4, 1, 0]])


BROKEN = [  # (argument, how it is broken, the message after "gather_spec_extras: ", to the letter)
    (1, strided, "topk_p_buf must be contiguous (the kernel reads it as rows), got strides (2,) for shape (5,)"),
    (3, lambda t: t.transpose(0, 1), "output_tokens_buf must be contiguous (the kernel reads it as rows)"),
    (4, lambda t: t[:, :, :1], "hidden_states_buf must be contiguous (the kernel reads it as rows), got strides "
                               "(8, 2, 1) for shape (5, 4, 1)"),
    (2, meta, "topk_index_buf is on meta, indices on cpu"),
    (0, lambda t: t.float(), "indices must be a 1-D integer tensor, got torch.float32 (3,)"),
    (0, lambda t: t.bool(), "indices must be a 1-D integer tensor, got torch.bool (3,)"),
    (0, lambda t: t[None], "indices must be a 1-D integer tensor, got torch.int64 (1, 3)"),
    (0, lambda t: t + 3, "indices must be in [0, 5), got [3, 7]"),
    (0, lambda t: t - 1, "indices must be in [0, 5), got [-1, 3]"),
]


@pytest.mark.parametrize("arg, broken, message", BROKEN)
def test_what_the_kernel_would_misread_is_refused(arg, broken, message):
    args = [torch.tensor([0, 4, 2]), *bufs()]
    if arg in (1, 3):  # a 1-D buffer for the strided and transposed cases
        args[arg] = args[arg][:, 0].contiguous() if arg == 1 else args[arg][:, None].expand(5, 2).contiguous()
    gather_spec_extras(*args)  # taken as SGLang passes them
    args[arg] = broken(args[arg])
    with pytest.raises(RuntimeError, match="^" + re.escape(f"gather_spec_extras: {message}")):
        gather_spec_extras(*args)


def test_a_row_past_the_shortest_buffer_is_refused():
    """Each buffer is read at every index: one shorter than the rest bounds the range (the kernel would read past
    its end)."""
    topk_p, topk_index, tokens, hidden = bufs(rows=5)
    with pytest.raises(RuntimeError, match=re.escape("gather_spec_extras: indices must be in [0, 3), got [0, 4]")):
        gather_spec_extras(torch.tensor([0, 4]), topk_p, topk_index, tokens, hidden[:3].contiguous())


@pytest.mark.sglang
def test_install_points_sglangs_overlap_future_map_at_the_stand_in(monkeypatch):
    overlap_utils = pytest.importorskip("sglang.srt.managers.overlap_utils")
    from treespec_sglang.plugin.cpu.overlap import install_overlap

    monkeypatch.setattr(overlap_utils, "gather_spec_extras", overlap_utils.gather_spec_extras)  # restored after
    install_overlap()
    assert overlap_utils.gather_spec_extras is gather_spec_extras


@pytest.mark.parametrize("active", [True, False])
def test_the_entry_point_installs_it_only_with_the_cpu_stand_ins(monkeypatch, active):
    installed = []
    monkeypatch.setattr(cpu, "install", lambda: active)
    monkeypatch.setattr("treespec_sglang.plugin.cpu.overlap.install_overlap", lambda: installed.append(1))
    monkeypatch.setattr(hooks, "register_hooks", lambda: None)
    plugin.register()
    assert installed == ([1] if active else [])
