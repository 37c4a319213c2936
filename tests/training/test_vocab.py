"""The reduced draft vocabulary (FR-Spec) from distillation data: answer counts first, overall counts on ties,
then the lower id; the EOS ids always in; exact counts past float32's integers."""

import pytest
import torch

from treespec_sglang.training.vocab import build_token_map, coverage


def item(toks, n_prompt):
    """A distillation item (tokens, states, loss mask): the first ``n_prompt`` tokens are the prompt."""
    toks = torch.as_tensor(toks)
    mask = torch.ones(len(toks), dtype=torch.bool)
    mask[:n_prompt] = False
    return (toks, None, mask)


def test_token_map_keeps_frequent_answer_tokens_and_eos():
    seqs = [item([1, 1, 1, 5, 5, 7], 3), item([2, 7, 5, 3], 1)]  # answers: 5 x3, 7 x2, 3 x1
    assert build_token_map(seqs, 2, vocab=10, always=[9]).tolist() == [9, 5]
    assert build_token_map(seqs, 3, vocab=10).tolist() == [5, 7, 3]
    assert build_token_map(seqs, 4, vocab=10).tolist() == [5, 7, 3, 1]  # then by overall count (1 x3)
    assert coverage(seqs, torch.tensor([5, 7])) == 5 / 6
    with pytest.raises(ValueError, match=r"size must be an integer in \[1, 10\]"):
        build_token_map(seqs, 11, vocab=10)


def test_answer_counts_add_up_over_every_sequence():
    # answers: 4 x1 + x1 = 2, 6 x1; 6 is also a prompt token twice (overall 3 > 4's 2), so only the
    # count summed over both sequences puts 4 first
    seqs = [item([6, 6, 4], 2), item([4, 6], 0)]
    assert build_token_map(seqs, 2, vocab=8).tolist() == [4, 6]


def test_sizes_at_the_bounds_and_exact_ties_by_id():
    seqs = [item([3, 1, 2], 0)]  # one answer each: tied everywhere but by id
    assert build_token_map(seqs, 1, vocab=4).tolist() == [1]
    V = 4096  # uncounted tokens: ties broken by the lower id (a stable sort), however many
    got = build_token_map(seqs, V, vocab=V)
    assert got.tolist()[:3] == [1, 2, 3] and got.tolist()[3:] == [0] + list(range(4, V))
    for bad in (0, V + 1, 2.0):
        with pytest.raises(ValueError, match=rf"^size must be an integer in \[1, {V}\], got {bad!r}$"):
            build_token_map(seqs, bad, vocab=V)


@pytest.mark.parametrize("case", ["answers", "overall"])
def test_counts_stay_exact_past_float32_integers(case):
    """Counts past 2**24 (float32's last exact integer), as in a large corpus: one more answer of token 2
    ranks it first ("answers"), and with equal answers one more occurrence overall does ("overall")."""
    big = 2 ** 24
    if case == "answers":  # token 2: big + 1 answers; token 1: big answers and 8 more prompt tokens
        seqs = [item(torch.full((big + 1,), 2), 0), item(torch.full((big,), 1), 0), item(torch.full((8,), 1), 8)]
    else:  # both big answers; token 2 once more in a prompt
        seqs = [item(torch.full((big,), 2), 0), item(torch.full((big,), 1), 0), item(torch.tensor([2]), 1)]
    assert build_token_map(seqs, 2, vocab=3).tolist() == [2, 1]


def test_coverage_of_a_single_answer_token():
    seqs = [item([4, 9], 1)]
    assert coverage(seqs, torch.tensor([9])) == 1.0
    assert coverage(seqs, torch.tensor([4])) == 0.0
    assert coverage([item([4], 1)], torch.tensor([4])) == 0.0  # no answers at all
