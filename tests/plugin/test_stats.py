"""Per-round stats bookkeeping that needs no running SGLang."""

import pytest
import torch

from treespec_sglang.plugin import stats as S


class Req:
    """A request of a round (its type has no ``stream`` attribute: a non-streamed request as some callers build it)."""

    def __init__(self):
        self.customized_info = None

    def finished(self):
        return False


# ---------------------------------------------------------------------------- the batch record against a plain model
import random  # noqa: E402
from types import SimpleNamespace  # noqa: E402


KEYS = list(S.ROUND_KEYS)


class Client:
    """A request as the output hook sees it."""

    def __init__(self, policy):
        self.policy, self.customized_info, self.stream, self.done = policy, None, False, False

    def finished(self):
        return self.done


def oracle_summary(values):
    """``values``: ``{key: every value recorded}`` -> the summary, summed here from scratch."""
    totals = {total: sum(values[key]) for key, (total, _) in S.ROUND_KEYS.items()}
    return dict(totals, rounds=len(values["treespec_accept_lengths"]), lists_truncated=False)


@pytest.mark.parametrize("fewest", [0, 32])  # a changed batch's members and sinks carried over, or built
@pytest.mark.parametrize("cap,fold", [(4096, 4096), (3, 2), (0, 2), (1, 5)])
@pytest.mark.parametrize("seed", range(3))
def test_batched_rounds_equal_a_plain_per_request_record(monkeypatch, series, cap, fold, seed, fewest):
    """Rounds of batches whose requests come and go (kept for several rounds, reordered, some native; a request
    that finishes commits nothing that round and leaves, its tree size and verify tokens of that round recorded
    or not, as under SGLang's overlap scheduler): every request's lists are its first ``cap`` values of its
    committed rounds, its summary counts every committed round (past the cap and folded too), the series' sums
    equal every value recorded, native requests stay untouched."""
    from treespec_sglang.plugin import batch_diff

    s, reg = series
    monkeypatch.setenv(S.ENV_MAX_ROUNDS, str(cap))
    monkeypatch.setattr(S, "FOLD", fold)
    monkeypatch.setattr(batch_diff, "FEWEST", fewest)
    rng = random.Random(seed)
    clients = [Client(rng.choice(["talon", "salf", None])) for _ in range(12)]
    seen = {id(c): {k: [] for k in KEYS} for c in clients}
    totals = {}
    alive, batch = list(clients), rng.sample(clients, 5)
    for _ in range(60):
        if rng.random() < 0.25 and alive:  # the batch changes: a request leaves, another joins, or the order changes
            batch = rng.sample(alive, rng.randint(1, min(7, len(alive))))
        if not batch:
            break
        finishing = rng.choice(batch) if rng.random() < 0.15 else None
        # the hooks pass the batch's columns' tuples (one object for the round's keys) or SGLang's own list
        held, names = (tuple(batch), tuple(c.policy for c in batch)) if rng.random() < 0.5 else (batch, None)
        for key in rng.sample(KEYS, 3):
            policies = names or [c.policy for c in batch]
            if key == "treespec_accept_lengths" and finishing is not None:
                policies = list(policies)
                policies[batch.index(finishing)] = None  # finished: the round commits nothing for it
            values = [rng.randint(0, 9) for _ in batch]
            S.record_rounds(held, policies, key, values)
            for c in batch:  # memory stays bounded: an overflow holds at most FOLD values before they are folded
                st = getattr(c, "_treespec_stats", None)
                assert st is None or len(st.overflow[key]) <= fold
            for c, p, v in zip(batch, policies, values):
                if p is not None:
                    seen[id(c)][key].append(v)
                    tot = totals.setdefault((p, key), [0, 0])
                    tot[0] += v
                    tot[1] += 1
        if finishing is not None:
            finishing.done = True
            alive.remove(finishing)
            batch = [c for c in batch if c is not finishing]
    for c in clients:
        if c.policy is None or not any(seen[id(c)].values()):
            assert c.customized_info is None
            continue
        rounds = len(seen[id(c)]["treespec_accept_lengths"])
        values = {k: v[:rounds] for k, v in seen[id(c)].items()}  # the finishing round's extra values cut
        want = oracle_summary(values)
        want["lists_truncated"] = any(len(v) > cap for v in values.values())
        assert S.summary_of(c) == want == c.customized_info[S.SUMMARY][0]
        for key in KEYS:
            assert c.customized_info[key] == values[key][:cap], key
        assert c.customized_info["treespec_policy"] == [c.policy]
    label = {"model_name": "m", "tp_rank": "0"}
    for (policy, key), (total, n) in totals.items():
        name = {"treespec_tree_sizes": "treespec:tree_size_sum", "treespec_verify_tokens":
                "treespec:verified_tokens_total", "treespec_accept_lengths": "treespec:accepted_draft_tokens_total"}
        assert reg.get_sample_value(name[key], dict(label, policy=policy)) == total
        if key == "treespec_accept_lengths":
            assert reg.get_sample_value("treespec:rounds_total", dict(label, policy=policy)) == n
    for policy in ("talon", "salf"):  # each request counted once, at its first round (carried batches' too)
        n = sum(c.policy == policy and any(seen[id(c)].values()) for c in clients)
        assert (reg.get_sample_value("treespec:requests_total", dict(label, policy=policy)) or 0) == n


def test_a_finished_requests_lists_end_at_its_last_committed_round():
    """Overlap scheduling: round 3 was drafted and verified before round 2's result showed the request finished;
    the response's lists stop at round 2, already-sent values untouched, the summary counts rounds 1-2."""
    req = Client("talon")
    for key, vals in (("treespec_tree_sizes", [5, 6, 7]), ("treespec_verify_tokens", [8, 8, 8]),
                      ("treespec_accept_lengths", [2, 3])):
        for v in vals:
            S.record_rounds([req], ["talon"], key, [v])
    assert S.summary_of(req) == {"rounds": 2, "tree_nodes": 11, "verified_tokens": 16, "accepted_tokens": 5,
                                 "lists_truncated": False}
    assert req.customized_info["treespec_tree_sizes"] == [5, 6] and req.customized_info["treespec_verify_tokens"] == [8, 8]


@pytest.mark.parametrize("values,got", [([3], "1 values of type int"), ([], "0 values of type None"),
                                        ([torch.tensor(3), torch.tensor(4)], "2 values of type Tensor")],
                         ids=["short", "none", "tensors"])
def test_values_that_are_not_one_int_per_request_are_refused(values, got):
    with pytest.raises(ValueError) as e:
        S.record_rounds([Client("talon"), Client("salf")], ["talon", "salf"], "treespec_tree_sizes", values)
    assert str(e.value) == (f"record_rounds('treespec_tree_sizes'): one Python int per request of the batch, got {got} "
                            "for 2 requests")


def test_a_batch_is_its_requests_by_identity_not_by_value():
    a, b = SimpleNamespace(customized_info=None), SimpleNamespace(customized_info=None)
    assert a == b  # SimpleNamespace compares by value; SGLang's Req by identity
    batch = S.BatchStats("treespec_tree_sizes", [a], ["talon"], 8)
    assert batch.holds([a], ["talon"], 8)
    assert not batch.holds([b], ["talon"], 8) and not batch.holds([a], [None], 8) and not batch.holds([a], ["talon"], 9)


def test_the_summary_goes_up_to_date_with_a_finished_requests_output():
    """The output hook (SGLang's accumulator's ``accept``) brings the summary up to date for a finished request
    before it is sent: a non-streamed request's as SGLang reads it, a stream's in its last chunk."""
    seen = []

    def accept(self, req):  # SGLang's accumulator: emits a chunk, reads customized_info as it is when called
        self.rids.append(req)
        seen.append(dict(req.customized_info).get(S.SUMMARY))

    for stream in (False, True):
        req, acc = Client("talon"), SimpleNamespace(rids=[], customized_info={})
        req.stream = stream
        S.record_rounds([req], ["talon"], "treespec_accept_lengths", [3])
        S.stream_accept(accept, acc, req=req)
        S.record_rounds([req], ["talon"], "treespec_accept_lengths", [2])
        req.done = True
        S.stream_accept(accept, acc, req=req)
        if stream:  # the hook sets each chunk's row of our keys: the summary with the last chunk only
            assert acc.customized_info[S.SUMMARY][0] == []
            summary = acc.customized_info[S.SUMMARY][1][0]
        else:
            assert seen[-2][0]["rounds"] == 0  # running: not sent, left as it was
            summary = seen[-1][0]
        assert summary["rounds"] == 2 and summary["accepted_tokens"] == 5, stream


@pytest.mark.parametrize("cap", [4096, 5])
@pytest.mark.parametrize("seed", range(3))
def test_a_streams_chunks_add_up_to_the_whole_lists(monkeypatch, cap, seed):
    """The output hook on a stream: a round recorded before each step, some steps emitting no chunk (SGLang's
    stream interval), the lists capped: accumulated as the tokenizer manager does (each chunk's values appended),
    the chunks carry each list whole, the policy once and the summary with the last chunk only; a native request in
    the same output batch carries none of them."""
    monkeypatch.setenv(S.ENV_MAX_ROUNDS, str(cap))
    rng = random.Random(seed)
    req, native = Client("salf"), Client(None)
    req.stream = native.stream = True
    req.send_token_offset = native.send_token_offset = 0
    native.customized_info = {"other": ["x"]}  # another plugin's key: left to SGLang

    def accept(self, req):  # SGLang's accumulator, as 0.5.23 treats request-level keys (ours are) of a stream
        if not req.emit:  # the stream interval: no chunk this step
            return
        self.rids.append(req)
        for key, values in (req.customized_info or {}).items():
            if req.send_token_offset == 0:  # a stream's request-level keys go with its first chunk only, as they are
                self.customized_info.setdefault(key, [[] for _ in range(len(self.rids) - 1)]).append(values)
        for column in self.customized_info.values():  # every column padded to the chunks
            column.extend([] for _ in range(len(self.rids) - len(column)))
        req.send_token_offset += 1

    got = {}
    for step in range(40):
        for key in KEYS:  # one round: its tree size, verify tokens and accept length
            S.record_rounds([req], ["salf"], key, [rng.randint(0, 9)])
        req.done = step == 39
        req.emit = native.emit = req.done or rng.random() < 0.6
        acc = SimpleNamespace(rids=[], customized_info={})
        S.stream_accept(accept, acc, req=native)
        S.stream_accept(accept, acc, req=req)
        ours = {k: col for k, col in acc.customized_info.items() if k != "other"}
        if req.emit:
            assert all(len(col) == 2 and col[0] == [] for col in ours.values())
            for key, col in ours.items():
                assert all(col[1] is not v for v in req.customized_info.values())  # a copy: the lists grow on
                got.setdefault(key, []).extend(col[1])
        assert native.customized_info == {"other": ["x"]}
    for key in KEYS:
        assert got[key] == req.customized_info[key] and len(got[key]) <= cap, key
    assert got["treespec_policy"] == ["salf"] and got[S.SUMMARY] == req.customized_info[S.SUMMARY]


def test_a_stream_never_sends_a_round_a_retraction_takes_back():
    """Under the overlap scheduler a round's verify tokens and tree size are recorded a round ahead of its accept
    length; a retraction then cuts that round (``uncommitted``). A chunk carries a round's values with its accept
    length only, so what a client sums is the server's lists (it kept the cut value: 13 where the server has 20)."""
    req = Client("salf")
    req.stream, req.send_token_offset = True, 0
    sizes, V, A = "treespec_tree_sizes", "treespec_verify_tokens", "treespec_accept_lengths"
    got = {}

    def accept(self, req):  # SGLang's accumulator for a stream's request-level keys (test above)
        self.rids.append(req)
        for key, values in (req.customized_info or {}).items():
            if req.send_token_offset == 0:
                self.customized_info.setdefault(key, [[] for _ in range(len(self.rids) - 1)]).append(values)
        req.send_token_offset += 1

    def chunk():
        acc = SimpleNamespace(rids=[], customized_info={})
        S.stream_accept(accept, acc, req=req)
        for key, col in acc.customized_info.items():
            got.setdefault(key, []).extend(col[0])

    def ahead(value):  # a round drafted and verified before the previous one's result
        S.record_rounds([req], ["salf"], sizes, [value % 7])
        S.record_rounds([req], ["salf"], V, [value])

    ahead(10)
    chunk()  # before any round's accept length: the policy goes out (once), no round's values yet
    assert got["treespec_policy"] == ["salf"] and all(got.get(k) == [] for k in (sizes, V, A)), got
    for k in range(1, 4):
        ahead(10 + k)
        S.record_rounds([req], ["salf"], A, [k])
        chunk()
    S.uncommitted(req)  # retracted: round 4 (13) commits nothing
    ahead(20)
    ahead(21)
    S.record_rounds([req], ["salf"], A, [7])
    chunk()
    S.record_rounds([req], ["salf"], A, [8])
    req.done = True
    chunk()
    assert req.customized_info[V] == [10, 11, 12, 20, 21] and req.customized_info[A] == [1, 2, 3, 7, 8]
    for key in (sizes, V, A):
        assert got[key] == req.customized_info[key], key
    assert got["treespec_policy"] == ["salf"]


def test_a_steady_batch_keeps_its_columns_and_looks_its_sinks_up_only_when_a_list_fills(monkeypatch):
    """Cap 4, FOLD 3, the same two requests for 11 rounds: one BatchStats throughout, its sinks looked up at the
    first round, when the lists reach the cap (round 5), when the overflow is full and folded (round 8) and again
    (round 11): every other round only appends. The lists hold the first 4 values, the summary all 11."""
    monkeypatch.setenv(S.ENV_MAX_ROUNDS, "4")
    monkeypatch.setattr(S, "FOLD", 3)
    monkeypatch.setattr(S, "_LAST", {})
    looked, real = [], S.BatchStats._look_up
    monkeypatch.setattr(S.BatchStats, "_look_up", lambda self: looked.append(len(looked)) or real(self))
    a, b = Client("talon"), Client("salf")
    batch, names, key = (a, b), ("talon", "salf"), "treespec_tree_sizes"
    S.record_rounds(batch, names, key, [1, 10])
    first = S._LAST[key]
    rounds = [[r, 10 * r] for r in range(2, 12)]
    for i, values in enumerate(rounds, start=2):
        S.record_rounds(batch, names, key, values)
        assert S._LAST[key] is first and len(looked) == 1 + (i >= 5) + (i >= 8) + (i >= 11), i
    assert a.customized_info[key] == [1, 2, 3, 4] and b.customized_info[key] == [10, 20, 30, 40]
    assert a._treespec_stats.summary()["tree_nodes"] == sum(range(1, 12))
    assert b._treespec_stats.summary()["tree_nodes"] == 10 * sum(range(1, 12))


def test_a_changing_batch_carries_its_sinks_and_a_new_cap_looks_them_up(monkeypatch):
    """A request leaves and another joins: the batch's sinks are carried over (no look-up), the new request's
    looked up alone, and every value lands in its request's list. Once the cap changes (the settings read
    again), a changed batch looks every sink up: a list already at the new cap takes no more values."""
    from treespec_sglang.plugin import batch_diff

    monkeypatch.setenv(S.ENV_MAX_ROUNDS, "8")
    monkeypatch.setattr(S, "_LAST", {})
    monkeypatch.setattr(batch_diff, "FEWEST", 1)  # two requests carried
    looked, real = [], S.BatchStats._look_up
    monkeypatch.setattr(S.BatchStats, "_look_up", lambda self: looked.append(1) or real(self))
    asked, real_of = [], S._stats_of
    monkeypatch.setattr(S, "_stats_of", lambda req, *a: asked.append(req) or real_of(req, *a))
    a, b, c, d = (Client(p) for p in ("talon", "salf", "talon", "salf"))
    key = "treespec_tree_sizes"
    for r in range(3):
        S.record_rounds((a, b), ("talon", "salf"), key, [r, 10 + r])
    for r in range(3, 5):
        S.record_rounds((a, c), ("talon", "talon"), key, [r, 20 + r])
    assert len(looked) == 1 and a.customized_info[key] == [0, 1, 2, 3, 4]
    assert asked == [c]  # the members carried over: only the new request's stats read
    assert b.customized_info[key] == [10, 11, 12] and c.customized_info[key] == [23, 24]
    monkeypatch.setenv(S.ENV_MAX_ROUNDS, "3")
    S.record_rounds((a, c, d), ("talon", "talon", "salf"), key, [5, 25, 35])
    assert len(looked) == 2
    assert a.customized_info[key] == [0, 1, 2, 3, 4] and c.customized_info[key] == [23, 24, 25]
    assert d.customized_info[key] == [35] and a._treespec_stats.summary()["tree_nodes"] == sum(range(6))


def test_a_request_without_customized_info_gets_one():
    req = SimpleNamespace()  # no customized_info attribute at all
    S.record_rounds([req], ["talon"], "treespec_tree_sizes", [3])
    assert req.customized_info["treespec_tree_sizes"] == [3] and req.customized_info["treespec_policy"] == ["talon"]


def test_the_output_hook_leaves_a_non_streamed_request_and_passes_positional_arguments_through():
    seen = []

    def accept(self, req):  # called positionally here: the hook passes what it was given
        self.rids.append(req)
        seen.append(req)

    req = Req()
    S.record_rounds([req], ["talon"], "treespec_tree_sizes", [3])
    acc = SimpleNamespace(rids=[], customized_info={})
    S.stream_accept(accept, acc, req)
    assert seen == [req] and acc.customized_info == {}  # SGLang sends a non-streamed request's keys itself
    streamed = Client("salf")
    streamed.stream = True
    S.record_rounds([streamed], ["salf"], "treespec_tree_sizes", [5])
    S.record_rounds([streamed], ["salf"], "treespec_accept_lengths", [2])  # the round's result: it goes out
    S.stream_accept(accept, acc, streamed)
    assert seen == [req, streamed] and acc.customized_info["treespec_tree_sizes"] == [[], [5]]
    native = Req()  # no stats: SGLang's at once, its arguments as given
    S.stream_accept(accept, acc, native)
    assert seen == [req, streamed, native] and acc.customized_info["treespec_tree_sizes"] == [[], [5]]


def test_one_output_batch_carries_each_streams_own_rows():
    """Two streams with a native request between them in one output batch: each of our columns has a row per chunk,
    each stream's values in its own row, an empty row for the native one (the accumulator pads nothing here)."""
    def accept(self, req):
        self.rids.append(req)

    first, native, second = Client("talon"), Client(None), Client("salf")
    first.stream = native.stream = second.stream = True
    for key in ("treespec_tree_sizes", "treespec_accept_lengths"):  # a round and its result
        S.record_rounds([first, native, second], ["talon", None, "salf"], key, [4, 9, 6])
    acc = SimpleNamespace(rids=[], customized_info={})
    for req in (first, native, second):
        S.stream_accept(accept, acc, req=req)
    assert acc.customized_info["treespec_tree_sizes"] == [[4], [], [6]]
    assert acc.customized_info["treespec_policy"] == [["talon"], [], ["salf"]]
