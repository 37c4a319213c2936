"""The filler unlink as one Triton launch (``unlink_kernel.unlink_filler_fused``) against plain loops and the torch
``unlink_filler``, entry by entry; its strictness; and :func:`draft_select.unlink`, which picks it with the selection.

CPU tensors run the kernel in Triton's interpreter (as the selection kernel's tests do); ``cuda`` cases are marked
``gpu`` and run it compiled."""

import random
import re

import pytest
import torch

from tests.plugin.kernel_cases import DEVICES, compiled_triton
from tests.plugin.pools import random_chains, unlink_oracle
from treespec_sglang.plugin import draft_select, unlink_kernel
from treespec_sglang.plugin.pool import unlink_filler

pytest.importorskip("triton")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N,bs", [(1, 2), (2, 3), (8, 5), (17, 4), (64, 3)])
def test_the_kernel_equals_plain_loops_and_the_torch_unlink(device, N, bs):
    """Random trees with random sibling orders and kept sets: every entry of both chains, in place."""
    for seed in range(3):
        nt, ns, keep = random_chains(random.Random(1000 * N + seed), bs, N)
        want_t, want_s = unlink_oracle(nt, ns, keep)
        ref = unlink_filler(nt, ns, keep)
        got_t, got_s, k = nt.to(device), ns.to(device), keep.to(device)
        unlink_kernel.unlink_filler_fused(got_t, got_s, k)
        assert got_t.cpu().tolist() == want_t and got_s.cpu().tolist() == want_s, (N, seed)
        assert torch.equal(got_t.cpu(), ref[0]) and torch.equal(got_s.cpu(), ref[1])
        assert torch.equal(k.cpu(), keep)  # keep is read only
    if N > 2:  # the cases reach fillers and chain ends
        assert (~keep).any() and (got_t == -1).any() and (got_s == -1).any()


def test_rows_of_sglangs_retrieve_buffer_are_taken_in_place():
    """SGLang hands ``retrieve_next_token`` / ``retrieve_next_sibling`` as rows 1 and 2 of one ``[3, bs, N]``
    buffer: contiguous views at an offset; the kernel writes them and leaves row 0 (``retrieve_index``) alone."""
    nt, ns, keep = random_chains(random.Random(7), 4, 12)
    buf = torch.stack([torch.arange(48).view(4, 12), nt, ns])
    unlink_kernel.unlink_filler_fused(buf[1], buf[2], keep)
    want_t, want_s = unlink_oracle(nt, ns, keep)
    assert buf[1].tolist() == want_t and buf[2].tolist() == want_s
    assert torch.equal(buf[0], torch.arange(48).view(4, 12))


@pytest.mark.parametrize("case,field", [
    (lambda nt, ns, k: (nt.t().contiguous().t(), ns, k), "next_token"),  # strided as a column slice
    (lambda nt, ns, k: (nt, ns.to(torch.int32), k), "next_sibling"),
    (lambda nt, ns, k: (nt, ns, k.to(torch.uint8)), "keep"),
    (lambda nt, ns, k: (nt[:, :4].contiguous(), ns, k), "next_token"),
])
def test_what_the_kernel_cannot_take_is_refused_naming_the_tensor(case, field):
    nt, ns, keep = random_chains(random.Random(3), 3, 6)
    before = (nt.clone(), ns.clone())
    with pytest.raises(ValueError, match=f"unlink_filler_fused: {field} must be a contiguous"):
        unlink_kernel.unlink_filler_fused(*case(nt, ns, keep))
    assert torch.equal(nt, before[0]) and torch.equal(ns, before[1])  # nothing written


@pytest.mark.parametrize("mode,fused", [("torch", False), ("auto", False), ("triton", True), ("graph", True)])
def test_the_hook_unlinks_with_the_selection_of_the_mode(monkeypatch, mode, fused):
    """``draft_select.unlink`` (what the verify-input hook calls): the kernel where the selection is the kernel
    (here on the CPU: ``triton`` and ``graph``; ``auto`` is torch off CUDA), the torch unlink elsewhere; the
    chains end the same either way, rewritten in the tensors SGLang handed over."""
    monkeypatch.setenv(draft_select.ENV_SELECT, mode)
    calls = []
    real = draft_select.unlink_filler_fused
    monkeypatch.setattr(draft_select, "unlink_filler_fused", lambda *a: calls.append(1) or real(*a))
    nt, ns, keep = random_chains(random.Random(11), 5, 9)
    want_t, want_s = unlink_oracle(nt, ns, keep)
    draft_select.unlink(nt, ns, keep)
    assert nt.tolist() == want_t and ns.tolist() == want_s
    assert bool(calls) == fused


def test_the_kernel_compiles_for_an_h100():
    """The compiled path: the unlink kernel compiles to sm_90 machine code (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pytest.importorskip("triton.backends.nvidia")
    if not compiled_triton():
        pytest.skip("triton was imported with TRITON_INTERPRET=1: nothing compiles in this process")
    sig = {"next_token_ptr": "*i64", "next_sibling_ptr": "*i64", "keep_ptr": "*i1", "work_ptr": "*i64", "N": "i32",
           "BLOCK_N": "constexpr", "ROUNDS": "constexpr"}
    src = ASTSource(unlink_kernel.kernels(False).unlink_kernel, signature=sig, constexprs={"BLOCK_N": 64, "ROUNDS": 7})
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


def jumping(rounds: int):
    """A launch of the unlink kernel with ``rounds`` rounds of pointer jumping (``launch_unlink``'s signature)."""
    def launch(mod, nt, ns, keep, work):
        mod.unlink_kernel[(keep.shape[0],)](nt, ns, keep, work, keep.shape[1], BLOCK_N=work.shape[1], ROUNDS=rounds)
    return launch


@pytest.mark.parametrize("N", [1, 2, 8, 33])
def test_the_start_check_passes_on_a_sound_kernel_and_stops_a_wrong_one(monkeypatch, N):
    """``check_unlink`` (run by ``check_selection`` at server start wherever the kernel will unlink): silent
    when the kernel agrees with torch; a kernel that writes nothing, or unlinks one round of jumps short, stops
    the start naming the way out."""
    unlink_kernel.check_unlink("cpu", N)
    if N <= 2:
        return  # the fixed trees keep every node of N 1 and 2: nothing to unlink, any kernel passes
    for broken in ((lambda *a: None), jumping(0)):
        monkeypatch.setattr(unlink_kernel, "launch_unlink", broken)
        with pytest.raises(RuntimeError, match="disagrees with the torch unlink on cpu at N .* TREESPEC_SELECT=torch"):
            unlink_kernel.check_unlink("cpu", N)


def test_the_start_check_leaves_the_rounds_scratch_alone(monkeypatch):
    """The start check unlinks with a scratch of its own: the rounds' shared one is first allocated by a round,
    on the forward stream its unlinks run on (one made on the start-up stream, freed when a bigger batch grows it
    while a round's unlink may still run, would go back to that stream's free blocks)."""
    monkeypatch.setattr(unlink_kernel, "_SCRATCH", {})
    unlink_kernel.check_unlink("cpu", 9)
    assert unlink_kernel._SCRATCH == {}
    nt, ns, keep = random_chains(random.Random(3), 2, 9)
    unlink_kernel.unlink_filler_fused(nt, ns, keep)
    assert list(unlink_kernel._SCRATCH) == [(16, torch.device("cpu"))]


@pytest.mark.parametrize("N,offsets", [(5, {0, 8}), (8, {0})])
def test_the_start_check_launches_every_alignment_sglangs_buffer_gives(monkeypatch, N, offsets):
    """Triton compiles a variant per 16-byte alignment of a pointer, and SGLang's ``retrieve_next_token`` is row 1
    of one ``[3, bs, N]`` int64 buffer (``bs * N * 8`` bytes in): with an odd N the start check launches both
    alignments, so no round compiles one; each launch's chains are checked (a wrong second launch stops it)."""
    seen, real = [], unlink_kernel.launch_unlink
    monkeypatch.setattr(unlink_kernel, "launch_unlink", lambda mod, nt, ns, keep, work: seen.append(
        (nt.data_ptr() % 16, ns.data_ptr() % 16)) or real(mod, nt, ns, keep, work))
    unlink_kernel.check_unlink("cpu", N)
    assert {t for t, _ in seen} == offsets and {s for _, s in seen} == {0} and len(seen) == 2
    monkeypatch.setattr(unlink_kernel, "launch_unlink", lambda mod, nt, ns, keep, work: (
        real(mod, nt, ns, keep, work) if nt.data_ptr() % 16 == 0 or N % 2 == 0 else None))
    if N % 2:
        with pytest.raises(RuntimeError, match="disagrees with the torch unlink"):
            unlink_kernel.check_unlink("cpu", N)


@pytest.mark.parametrize("mode,topk,checked", [("triton", 4, True), ("triton", 1, True), ("graph", 1, True),
                                               ("torch", 4, False), ("auto", 4, False)])
def test_the_server_start_checks_the_unlink_wherever_it_takes_the_kernel(monkeypatch, mode, topk, checked):
    """On the CPU: ``triton`` / ``graph`` servers (chain servers too, which unlink but never select) check it at
    their N; ``torch`` and ``auto`` (torch off CUDA) do not load it."""
    monkeypatch.setenv(draft_select.ENV_SELECT, mode)
    seen = []
    monkeypatch.setattr(draft_select, "check_unlink", lambda dev, n: seen.append(n))
    monkeypatch.setattr(draft_select, "warm_up", lambda *a: None)
    draft_select.check_selection("cpu", topk, 3, 7)
    assert seen == ([7] if checked else [])


@pytest.mark.parametrize("fill", [-1, 0, 5, 2 ** 40])
def test_the_kept_scratch_is_reused_and_what_it_held_never_leaks(fill):
    """A round allocates no scratch (one per batch size and device, kept), and whatever the scratch holds from
    an earlier round (here poisoned: -1, in-range node ids, huge values) never reaches the chains."""
    nt, ns, keep = random_chains(random.Random(21), 6, 11)
    want_t, want_s = unlink_oracle(nt, ns, keep)
    unlink_kernel.unlink_filler_fused(nt.clone(), ns.clone(), keep)
    scratch = unlink_kernel._unlink_scratch(6, 11, keep.device)
    scratch.fill_(fill)
    got_t, got_s = nt.clone(), ns.clone()
    unlink_kernel.unlink_filler_fused(got_t, got_s, keep)
    assert unlink_kernel._unlink_scratch(6, 11, keep.device) is scratch
    assert got_t.tolist() == want_t and got_s.tolist() == want_s


def test_the_scratch_is_one_buffer_per_width_grown_by_doubling(monkeypatch):
    """Every batch size's scratch is the first rows of one buffer (memory bounded by twice the largest batch, where a
    buffer per batch size piled up over a day of drifting sizes); a bigger batch doubles it, and every size's
    chains stay right across the growth."""
    monkeypatch.setattr(unlink_kernel, "_SCRATCH", {})
    views = {bs: unlink_kernel._unlink_scratch(bs, 11, torch.device("cpu")) for bs in (4, 2, 4)}
    buf = unlink_kernel._SCRATCH[(16, torch.device("cpu"))][0]
    assert buf.shape == (4, 16) and views[2].data_ptr() == views[4].data_ptr() == buf.data_ptr()
    assert unlink_kernel._unlink_scratch(5, 11, torch.device("cpu")).shape == (5, 16)
    assert unlink_kernel._SCRATCH[(16, torch.device("cpu"))][0].shape == (8, 16)  # doubled, not 5
    assert unlink_kernel._unlink_scratch(20, 11, torch.device("cpu")).shape == (20, 16)
    for bs in (3, 20, 7):
        nt, ns, keep = random_chains(random.Random(bs), bs, 11)
        want_t, want_s = unlink_oracle(nt, ns, keep)
        unlink_kernel.unlink_filler_fused(nt, ns, keep)
        assert nt.tolist() == want_t and ns.tolist() == want_s
    assert len(unlink_kernel._SCRATCH) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_single_request_is_unlinked_too(device):
    """bs 1 (one request in flight, the commonest batch): its chains are rewritten like any other batch's."""
    changed = []
    for seed in range(4):
        nt, ns, keep = random_chains(random.Random(77 + seed), 1, 8)
        want_t, want_s = unlink_oracle(nt, ns, keep)
        got_t, got_s = nt.clone().to(device), ns.clone().to(device)
        unlink_kernel.unlink_filler_fused(got_t, got_s, keep.to(device))
        assert got_t.cpu().tolist() == want_t and got_s.cpu().tolist() == want_s
        changed.append((want_t, want_s) != (nt.tolist(), ns.tolist()))
    assert sum(changed) >= 2  # most of the cases had something to unlink


@pytest.mark.parametrize("N", [1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65])
def test_the_scratch_row_is_the_smallest_power_of_two_holding_every_node(N):
    want = 2
    while want < N:
        want *= 2
    assert unlink_kernel._block_n(N) == want


@pytest.mark.parametrize("N", [8, 33])
def test_the_start_check_stops_a_kernel_one_round_of_jumps_short_or_leaving_a_chain_alone(monkeypatch, N):
    """The start check's fixed trees hold runs of fillers on a chain, so one round of pointer jumping is not enough;
    and both chains are compared (a kernel that rewrote next_token alone stops the start, the message showing
    next_token against torch's next_token)."""
    real = unlink_kernel.launch_unlink
    one_round = jumping(1)

    def siblings_left(mod, nt, ns, keep, work):
        before = ns.clone()
        real(mod, nt, ns, keep, work)
        ns.copy_(before)

    for broken in (one_round, siblings_left):
        monkeypatch.setattr(unlink_kernel, "launch_unlink", broken)
        with pytest.raises(RuntimeError, match="disagrees with the torch unlink") as e:
            unlink_kernel.check_unlink("cpu", N)
        if broken is siblings_left:  # next_token was right: the message shows it equal to torch's
            got, want = re.search(r"got next_token (\[.*\]), want (\[.*\])\)", str(e.value)).groups()
            assert got == want
