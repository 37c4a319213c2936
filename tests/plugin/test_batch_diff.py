"""``batch_diff.diff``: how a decode batch came from the one before, checked against a plain reading of both
batches (which requests each position holds), on the changes SGLang's scheduler makes and on arbitrary ones."""

import random

import pytest

from treespec_sglang.plugin import batch_diff


class Req:
    """A request whose value equality holds for any two: the diff must match by identity alone."""

    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return True

    __hash__ = object.__hash__

    def __repr__(self):
        return self.name


@pytest.fixture(autouse=True)
def no_memo(monkeypatch):
    """No change remembered from another test; any batch size carried (the small-batch rule has its own test)."""
    monkeypatch.setattr(batch_diff, "_LAST", type(batch_diff._LAST)(maxlen=2))
    monkeypatch.setattr(batch_diff, "FEWEST", 0)


class Made(list):
    """Every request made so far; ``swapped``: the last change reordered the batch."""

    swapped = False


def scheduler_change(rng, old, made):
    """What SGLang's scheduler does to a running batch: finished requests filtered out (order kept), new ones
    merged at the end, now and then a retraction's reorder (two requests swapped, ``made`` marked)."""
    new = [r for r in old if rng.random() > 0.08]
    if rng.random() < 0.1 and len(new) > 2:  # retract_decode sorts the batch before it drops requests
        i, j = rng.sample(range(len(new)), 2)
        new[i], new[j] = new[j], new[i]
        made.swapped = True
    for _ in range(rng.choice([0, 0, 1, 2, 5])):
        made.append(Req(f"r{len(made)}"))
        new.append(made[-1])
    return tuple(new)


def arbitrary_change(rng, old, made):
    """Any batch of old and new requests, each at most once, in any order."""
    pool = list(old) + [Req(f"r{len(made) + i}") for i in range(rng.randint(0, 6))]
    made.extend(pool[len(old):])
    return tuple(rng.sample(pool, rng.randint(0, len(pool))))


def check(old, new, change):
    """The change against the two batches read position by position."""
    assert change.old_len == len(old) and change.new_len == len(new)
    at, last_old = 0, -1
    for kept, i, j in change.pieces:
        assert j > i
        if kept:  # old[i:j] are the new batch's next j - i requests, the same objects, later than any kept before
            assert i > last_old and all(a is b for a, b in zip(old[i:j], new[at:at + j - i]))
            last_old, at = j - 1, at + j - i
        else:  # positions of the new batch, in order
            assert i == at
            at = j
    assert at == len(new)
    # a column carried over equals the one built for the new batch; fresh is asked for new positions only
    asked = []
    column = change.apply(tuple(r.name for r in old), lambda i, j: asked.append((i, j)) or [r.name for r in new[i:j]])
    assert column == tuple(r.name for r in new) and asked == change.fresh()
    kept_ids = {id(r) for kept, i, j in change.pieces if kept for r in old[i:j]}
    assert [r.name for run in change.removed(old) for r in run] == [r.name for r in old if id(r) not in kept_ids]
    assert all(len(run) for run in change.removed(old))
    return sum(j - i for kept, i, j in change.pieces if kept)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("how", [scheduler_change, arbitrary_change])
def test_a_change_tiles_the_new_batch_and_carries_columns_over(seed, how):
    """Over 200 changes of a batch of up to 64 requests: the pieces tile the new batch in order (kept runs in the
    old batch's order, matched by identity though every request equals every other), a column carried over
    equals the new batch's read afresh, ``removed`` holds what left. A scheduler's change (filter, merge) keeps
    every request that stays, and is no diff only past MOST pieces (or a quarter of the new batch)."""
    rng = random.Random(seed)
    made = Made(Req(f"r{i}") for i in range(rng.randint(0, 64)))
    old = tuple(made)
    for _ in range(200):
        made.swapped = False
        new = how(rng, old, made)[:64]
        change = batch_diff.diff(old, new)
        most = max(batch_diff.MOST, len(new) // 4)
        plain = how is scheduler_change and not made.swapped
        if plain:  # filtered and merged: a piece per run of consecutive old requests, and one for the new ones
            at = {id(r): i for i, r in enumerate(old)}
            where = [at[id(r)] for r in new if id(r) in at]
            runs = len(where) and 1 + sum(b != a + 1 for a, b in zip(where, where[1:]))
            assert (change is None) == (runs + (len(where) < len(new)) > most)
        if change is not None:
            assert len(change.pieces) <= most
            kept = check(old, new, change)
            if plain:  # every request that stays is carried over
                assert kept == len(where)
            assert change.same == (len(old) == len(new) and all(a is b for a, b in zip(old, new)))
        old = new


def test_the_same_batch_is_one_kept_piece_and_an_empty_one_none():
    reqs = tuple(Req(str(i)) for i in range(5))
    assert batch_diff.diff(reqs, tuple(reqs)).same
    assert batch_diff.diff((), ()).same and batch_diff.diff((), ()).pieces == ()
    assert batch_diff.diff(reqs, ()).pieces == () and not batch_diff.diff(reqs, ()).same
    assert batch_diff.diff((), reqs).pieces == ((False, 0, 5),)
    # equal but other objects: nothing kept
    assert batch_diff.diff(reqs, tuple(Req(str(i)) for i in range(5))).pieces == ((False, 0, 5),)


def test_too_many_pieces_is_no_diff():
    """Old and new requests in turn: two pieces a request kept. Past MOST pieces (or a quarter of the new batch,
    when more) the change is no diff, and the batch is rebuilt."""
    for size in (4, 40):
        reqs = tuple(Req(str(i)) for i in range(size))
        for kept in range(1, size + 1):
            new = tuple(r for pair in zip(reqs[:kept], (Req(f"new{i}") for i in range(kept))) for r in pair)
            change = batch_diff.diff(reqs, new)
            assert (change is None) == (2 * kept > max(batch_diff.MOST, len(new) // 4)), kept
            if change is not None:
                check(reqs, new, change)


def test_a_large_batch_carries_more_pieces():
    """Of 128 requests every 12th leaves and one joins: 11 kept runs and the new one, past MOST but within a
    quarter of the batch, so carried over."""
    reqs = tuple(Req(str(i)) for i in range(128))
    new = tuple(r for i, r in enumerate(reqs) if i % 12 != 11) + (Req("new"),)
    change = batch_diff.diff(reqs, new)
    assert change is not None and len(change.pieces) == 12 > batch_diff.MOST
    check(reqs, new, change)


@pytest.mark.parametrize("fewest", [1, 5, 32])
def test_a_change_that_keeps_fewer_than_fewest_requests_is_no_diff(monkeypatch, fewest):
    """Batches of up to 40 requests, one leaving and one joining each time: a change is given exactly when it
    keeps at least FEWEST requests (either batch smaller than that keeps fewer)."""
    monkeypatch.setattr(batch_diff, "FEWEST", fewest)
    for size in range(0, 41):
        reqs = tuple(Req(str(i)) for i in range(size))
        for gone in {0, size // 2, size - 1} if size else {0}:
            new = reqs[:gone] + reqs[gone + 1:] + (Req("new"),)
            kept = max(size - 1, 0)
            change = batch_diff.diff(reqs, new)
            assert (change is not None) == (kept >= fewest), (size, gone)
            if change is not None:
                check(reqs, new, change)
        replaced = tuple(Req(f"other{i}") for i in range(size))  # every request new: nothing to keep
        assert (batch_diff.diff(reqs, replaced) is None) == (fewest > 0)


def test_a_noted_column_knows_what_it_was_carried_from(monkeypatch):
    """``apply(..., noted=True)`` keeps the column's lineage (the last four, by identity): a value built from the
    old column can be carried with it. A column not noted, or noted too long ago, has none."""
    monkeypatch.setattr(batch_diff, "_LINEAGE", type(batch_diff._LINEAGE)(maxlen=4))
    reqs = tuple(Req(str(i)) for i in range(5))
    change = batch_diff.diff(reqs, reqs[1:])
    old = tuple("abcde")
    first = change.apply(old, list, noted=True)
    assert first == tuple("bcde") and batch_diff.carried_from(first) == (old, change)
    assert batch_diff.carried_from(tuple("bcde")) is None and batch_diff.carried_from(change.apply(old, list)) is None
    later = [change.apply(tuple(f"{k}{c}" for c in old), list, noted=True) for k in range(4)]
    assert batch_diff.carried_from(first) is None and batch_diff.carried_from(later[0])[1] is change


@pytest.mark.parametrize("run", [3, 4, 5])
def test_pieces_up_to_a_quarter_of_a_large_batch_are_carried(run):
    """50 kept runs of ``run`` requests each (one request left between runs): 50 pieces in a new batch of 50 * run,
    within its quarter from runs of 4 on."""
    reqs = tuple(Req(str(i)) for i in range(50 * (run + 1)))
    new = tuple(r for i, r in enumerate(reqs) if i % (run + 1) != run)
    change = batch_diff.diff(reqs, new)
    assert len(new) == 50 * run and (change is None) == (50 > len(new) // 4)
    if change is not None:
        assert len(change.pieces) == 50
        check(reqs, new, change)


def test_the_last_changes_are_kept_by_identity():
    """The batch's caches ask for the same change in turn: the same two tuples get the same answer, two others
    holding the same requests a new one, equal to it."""
    a, b, c = Req("a"), Req("b"), Req("c")
    old, new = (a, b), (a, c)
    first = batch_diff.diff(old, new)
    assert batch_diff.diff(old, new) is first
    again = batch_diff.diff(old, tuple(list(new)))
    assert again is not first and again.pieces == first.pieces == ((True, 0, 1), (False, 1, 2))
    last = (c,)
    other = batch_diff.diff(new, last)
    assert batch_diff.diff(new, last) is other and batch_diff.diff(old, new) is not first  # two kept: the last two
