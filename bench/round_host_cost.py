"""The host's cost of the plugin's hooks over one whole speculative round, treespec against native, per batch size.

``select_host_cost.py`` measures the selection alone. This drives every hook a decode round passes through, in
SGLang 0.5.23's order, with SGLang's own work stood in by functions that return prepared tensors at once:
``forward_batch_generation`` (opens the round) -> ``draft`` -> ``prepare_for_draft`` (a replayed draft graph;
``--eager``: an eager one, then ``organize_draft_results`` runs on the host too) -> ``build_eagle_verify_input``
(the selection, the token cap, the agreement, the filler unlink) -> the target verify's ``ModelRunner.forward``
(ragged or not; the verify-token stats) -> ``_resolve_spec_v2_tokens`` (the accept-length stats, the tree sizes
of the rounds before). What is left is the hooks' own host time: their Python and the ATen ops they dispatch
(on a GPU each an async launch of about 5-10 us of host time). The selection's device work is stubbed as in
``select_host_cost.py``: the graph body / the kernel launch / the unlink launch do nothing (chain mode's cut graph
computes in its first round, and its replays after it do nothing); the verify group is None (one rank).

A native batch (no request with a policy) goes through the same hooks, which then call straight through: the
difference is what a treespec round adds on the host. ``--metrics`` turns on the plugin's Prometheus series (a
server started with ``--enable-metrics``).

    python bench/round_host_cost.py                         # bs 1 / 16 / 64, topk 4, steps 3, N 8
    python bench/round_host_cost.py --select graph --metrics --json out.json
    python bench/round_host_cost.py --topk 1 --steps 5 --N 6 --sets native,chain,chain-lengths   # chain mode

Per row: microseconds per round (median of ``--repeats`` steady-state rounds, the same requests every round;
``--churn K``: K requests leave and K join every round, as SGLang filters and merges its decode batch; ``--stream``:
every request streamed, the round's output hook included), ATen ops dispatched, host reads; ``--breakdown`` adds
the 12 functions with the most own time (cProfile).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from types import SimpleNamespace
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from treespec_sglang.plugin import (chain_graph, chain_stop, draft_select, hooks, metrics, pool,  # noqa: E402
                                     pool_kernels, select_graph, server_hooks, settings, stats, unlink_kernel)
from treespec_sglang.utils.syncs import count_ops  # noqa: E402
from bench.select_host_cost import pool_lists, sglang_pool  # noqa: E402

SETS = {"native": [None],
        "eagle2": [{"policy": "eagle2"}],  # its default budget keeps SGLang's own tree: served as a native round
        "eagle2-small": [{"policy": "eagle2", "budget": 4}],  # a tree of its own: selected and unlinked
        "mix": [None, {"policy": "eagle2"}, {"policy": "talon", "mu": 0.03}, {"policy": "salf", "th": 0.1},
                {"policy": "c2t", "beta": 0.5}, {"policy": "chain"}],
        # chain mode (--topk 1, N = steps + 1): C2T stops, a shorter chain, speculation off, native
        "chain": [None, {"policy": "chain", "beta": 0.5}, {"policy": "chain", "length": 2}, {"policy": "none"}],
        "chain-lengths": [None, {"policy": "chain", "length": 2}, {"policy": "none"}]}


class Req:
    """The parts of SGLang's ``Req`` the hooks read."""

    def __init__(self, spec):
        self.sampling_params = SimpleNamespace(custom_params={"treespec": spec} if spec else None)
        self.customized_info = None
        self.stream = False  # --stream: every round emits a chunk for it (SGLang's default stream interval)
        self.is_retracted = False
        self.finished_reason = None

    def finished(self) -> bool:
        return self.finished_reason is not None


def _emit(acc, req) -> None:
    """SGLang's ``_GenerationStreamAccumulator.accept`` stood in: a chunk for ``req``."""
    acc.rids.append(req)


class FakeRound:
    """One decode round of SGLang's EAGLE v2 worker with its own work stood in (see the module docstring)."""

    def __init__(self, specs, bs, k, S, N, device, eager, churn=0, stream=False):
        self.k, self.S, self.N, self.eager, self.churn, self.specs = k, S, N, eager, churn, specs
        self.stream = stream
        self.reqs = [self.streamed(Req(specs[i % len(specs)])) for i in range(bs)]
        # requests replaced so far, the next round's new requests (:meth:`prepare`), the requests that left
        self.turn, self.arrivals, self.left = 0, [], []
        scores, tokens, parents = sglang_pool(bs, k, S, device)
        self.lists = pool_lists(scores, tokens, parents, k)
        # SGLang's own selection: (parent_list, top_scores_index [bs, N-1], draft_tokens [bs, N-1])
        self.native = pool.select_on_pool(pool.PoolView.from_flat(scores, tokens, parents, k), N, [None] * bs)[:3]
        draft_select.stash_pool(*self.lists, self.native[1])  # what the captured draft graph's organize writes
        if k == 1:  # chain mode: what a draft graph captured with TREESPEC_CHAIN_STOP_GRAPH=1 records each replay
            for i in range(S - 1):
                chain_stop.record_step(torch.randn(bs, 1000, device=device), i, S)
        self.chains = [torch.full((bs, N), -1, dtype=torch.long, device=device) for _ in range(2)]  # [bs, N] each
        self.worker = SimpleNamespace(topk=k, speculative_num_steps=S, speculative_num_draft_tokens=N, device=device)
        self.runner = SimpleNamespace(bs=bs)  # SGLang's draft graph runner (a replay of a bs-row graph)
        self.target = SimpleNamespace(attn_backend=SimpleNamespace())  # Triton attention: no ragged verify
        self.verify_batch = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True), spec_info=None)
        self.result = SimpleNamespace(num_correct_drafts_per_req_cpu=[2] * bs)
        self.batch = SimpleNamespace(reqs=self.reqs)

    def arrival(self, turn: int) -> Req:
        """A request joining the batch at churn ``turn``, parsed as the scheduler's request hook does when it
        arrives (``_create_generation_req``, before any round)."""
        r = self.streamed(Req(self.specs[turn % len(self.specs)]))
        server_hooks._req_params(r, server_hooks.server_defaults())
        return r

    def streamed(self, r: Req) -> Req:
        r.stream = self.stream
        return r

    def prepare(self) -> None:
        """The next round's arrivals, made outside its timing: a round pays what a new member costs it, not the
        parse."""
        self.arrivals = [self.arrival(self.turn + self.churn - i) for i in range(self.churn)]

    def _organize(self, *a, **kw):
        return self.native

    def _build(self, *a, **kw):
        return SimpleNamespace(retrieve_next_token=self.chains[0], retrieve_next_sibling=self.chains[1])

    def _draft(self, worker, batch):
        hooks._prepare_for_draft(("forward_batch", not self.eager, None), None, None, batch, self.runner)
        if not self.eager:  # SGLang's draft graph replays (its runner's execute)
            hooks._draft_replayed(None, self.runner, "forward_batch")
        parent_list, top, tokens = self.native
        if self.eager:  # a replayed graph ran organize_draft_results on the device, its hook never on the host
            parent_list, top, tokens = hooks._organize(self._organize, *self.lists[:3], self.N)
        return hooks._build_verify_input(self._build, batch, None, parent_list, top, tokens, None, None, self.k,
                                         self.S, self.N, None, None)

    def _round(self, worker, batch):
        hooks._draft(lambda w, b: self._draft(w, b), self.worker, batch)
        hooks._runner_forward(lambda runner, fb: None, self.target, self.verify_batch)
        hooks._record_accepts(None, None, self.result, batch)
        if self.stream:  # the round's output: SGLang's accumulator takes each request (a chunk each, stood in)
            acc = SimpleNamespace(rids=[], customized_info={})
            for req in batch.reqs:
                stats.stream_accept(_emit, acc, req=req)

    def __call__(self):
        if self.churn:  # as SGLang's scheduler: finished requests filtered out, new ones merged at the end
            reqs = list(self.reqs)
            for _ in range(min(self.churn, len(reqs))):
                self.turn += 1
                gone = reqs.pop(self.turn * 7 % len(reqs))
                gone.finished_reason = "length"
                self.left.append(gone)
                reqs.append(self.arrivals.pop() if self.arrivals else self.arrival(self.turn))
            self.reqs = self.batch.reqs = reqs
        hooks._eagle_round(lambda w, b: self._round(w, b), self.worker, self.batch)


@contextlib.contextmanager
def patched(a):
    """The stand-ins of :func:`measure` (``a.select`` in the environment, the device work stubbed), undone after."""
    real_cut = chain_graph.CutGraph._body

    def cut_once(self):  # the chain cut graph's body: computed in its first round (its rows in), later replays stubbed
        if self.static_rows.seen is not None and not getattr(self, "_bench_cut", False):
            self._bench_cut = True
            real_cut(self)

    patches = [mock.patch.dict(os.environ, {draft_select.ENV_SELECT: a.select, chain_stop.ENV_CHAIN_GRAPH: "1"}),
               mock.patch.object(select_graph.SelectionGraph, "_body", lambda self: None),
               mock.patch.object(chain_graph.CutGraph, "_body", cut_once),
               mock.patch.object(pool_kernels, "launch", lambda *x, **y: None),
               mock.patch.object(unlink_kernel, "launch_unlink", lambda *x, **y: None),
               # in a server the verify group is a dict read of SGLang's parallel context; outside one its lookup
               # takes an exception path that would cost more than the rest of the hooks (ranks.verify_group)
               mock.patch.object(draft_select, "verify_group", lambda: None),
               mock.patch.object(hooks, "verify_group", lambda: None)]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def measure(name, bs, a, env="frozen"):
    """``(us per round, ops, reads, breakdown, the FakeRound)`` of a round of set ``name`` at ``bs`` requests;
    ``env``: ``frozen`` (the settings read from the snapshot the draft worker's start takes, as in a server) or
    ``live`` (every read from ``os.environ``, as before the snapshot existed)."""
    if env not in ("frozen", "live"):
        raise ValueError(f"--env takes frozen or live, got {env!r}")
    with patched(a):
        if env == "frozen":
            settings.freeze()
        try:
            one = FakeRound(SETS[name], bs, a.topk, a.steps, a.N, a.device, a.eager, a.churn, a.stream)
            # builds the rows, tables, the graphs and records the first stats; under churn, until every set has
            # joined once (a server loads its classifiers and captures their graphs at start: not a round's cost)
            for _ in range(3 + (len(SETS[name]) if a.churn else 0)):
                one()
            with count_ops() as c:
                one()
            times = []
            for _ in range(a.repeats):
                one.prepare()
                t = time.perf_counter()
                one()
                times.append((time.perf_counter() - t) * 1e6)
            breakdown = None
            if a.breakdown:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(a.repeats):
                    one()
                prof.disable()
                st = pstats.Stats(prof)
                top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:12]  # own time
                breakdown = [(f"{os.path.basename(f)}:{ln} {fn}", round(1e6 * tt / a.repeats, 1))
                             for (f, ln, fn), (_, _, tt, _, _) in top]
        finally:
            settings.thaw()
    return statistics.median(times), c.ops, c.reads, breakdown, one


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bs", default="1,16,64")
    ap.add_argument("--sets", default="native,eagle2,eagle2-small,mix")
    ap.add_argument("--select", default="graph", choices=draft_select.SELECT_MODES)
    ap.add_argument("--eager", action="store_true", help="an eager draft (organize's hook runs on the host)")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--metrics", action="store_true", help="the plugin's Prometheus series on")
    ap.add_argument("--env", default="frozen", help="comma list: frozen (the settings' snapshot a server reads "
                    "once its draft worker started), live (every read from os.environ)")
    ap.add_argument("--breakdown", action="store_true", help="the functions with the most own time (cProfile)")
    ap.add_argument("--churn", type=int, default=0, help="requests replaced by new ones every round (a "
                    "server's batch at high concurrency changes most rounds); 0: the same requests every round")
    ap.add_argument("--stream", action="store_true", help="every request streamed: each round ends with SGLang's "
                    "output accumulator taking each request (the plugin's output hook), a chunk each")
    ap.add_argument("--json")
    return ap


def main(argv=None):
    a = parser().parse_args(argv)
    torch.set_num_threads(1)
    if a.metrics:
        metrics.enable_scheduler({"model_name": "bench"})
    from treespec_sglang.engine.cost import _cpu_name
    machine = f"{_cpu_name()}, torch {torch.__version__}, device {a.device}"
    print(f"# hooks' host cost per round, select {a.select}{' (eager draft)' if a.eager else ''}, topk {a.topk}, "
          f"steps {a.steps}, N {a.N}, metrics {'on' if a.metrics else 'off'}; {machine}")
    out = []
    for bs in (int(b) for b in a.bs.split(",")):
        for name in a.sets.split(","):
            for env in a.env.split(","):
                us, ops, reads, breakdown, _ = measure(name, bs, a, env)
                row = dict(set=name, bs=bs, env=env, us=round(us, 1), ops=ops, reads=reads)
                out.append(dict(row, breakdown=breakdown))
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                for fn, us_own in breakdown or ():
                    print(f"    {us_own:8.1f} us  {fn}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(machine=machine, args=vars(a), rows=out), f, indent=1)


if __name__ == "__main__":
    main()
