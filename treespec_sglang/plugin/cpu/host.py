"""Run one real ``sgl.Engine`` on the CPU in a child process and talk to it over stdin/stdout.

SGLang reads ``SGLANG_USE_CPU_ENGINE`` once, at import, in every module, and its engine module imports
``sgl_kernel`` ops at import time; a host process sets the CPU environment, installs the stand-ins
(:func:`treespec_sglang.plugin.cpu.install`) before anything of ``sglang.srt`` is imported, and
keeps all of that out of the caller's process (tests, benchmarks).

Protocol: one JSON object per line on the child's stdin (``{"op": "generate", "kwargs": {...}}``,
``{"op": "call", "method": "flush_cache" | "get_server_info"}`` or ``{"op": "shutdown"}``); each answer is one
stdout line
``@@treespec@@ {"ok": ..., "result" | "error": ..., "seconds": ...}``.

>>> host = EngineHost("eagle", cpu_engine_kwargs(target, **eagle_kwargs(draft)), log_dir)   # doctest: +SKIP
>>> host.generate(input_ids=[[1, 2, 3]], sampling_params=[{"max_new_tokens": 8}])          # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

__all__ = ["EngineHost", "cpu_engine_kwargs", "eagle_kwargs", "allow_cpu_overlap", "CPU_ENV", "threads_bind"]

MARK = "@@treespec@@ "
START_TIMEOUT = 600
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1",
           "TORCHDYNAMO_DISABLE": "1"}  # SGLang torch.compiles select_top_k (20 s, same output)


def cpu_engine_kwargs(target: str, overlap: bool = False, **spec) -> dict:
    """``sgl.Engine`` arguments for SGLang's CPU path (float32, intel_amx attention, no graphs).

    ``sleep_on_idle``: an idle SGLang scheduler otherwise polls its sockets nonstop, a whole core each
    (measured: 30 CPU-seconds per 30 idle seconds, 1 with it), which on a small machine halves the speed
    of any other engine running beside it. ``overlap``: SGLang's overlap scheduler, the default of a GPU server,
    which SGLang turns off for speculative decoding on a CPU (the host lets it run: :func:`allow_cpu_overlap`)."""
    kw = dict(model_path=target, device="cpu", attention_backend="intel_amx", dtype="float32",
              disable_cuda_graph=True, max_total_tokens=8192, max_running_requests=32, log_level="warning",
              random_seed=0, sleep_on_idle=True)
    if overlap:
        kw.update(disable_overlap_schedule=False, treespec_overlap=True)
    kw.update(spec)
    return kw


def allow_cpu_overlap() -> None:
    """Let SGLang's overlap scheduler serve a speculative engine on the CPU (the test bed's way to run the
    scheduling a GPU server runs by default). SGLang 0.5.23 turns it off there while it resolves the server
    arguments ("Overlap schedule is not implemented for speculative decoding on CPU",
    ``arg_groups.speculative_hook._disable_overlap_schedule_for_cpu``); with that step skipped the overlap loop
    runs on torch's CPU streams and events, which do nothing (one stream: each forward has finished when it
    returns). What it exercises is the scheduling: a batch's results processed after the next batch is launched,
    a prefill's requests merged into the next decode batch before their results finish them."""
    from sglang.srt.arg_groups import speculative_hook

    speculative_hook._disable_overlap_schedule_for_cpu = lambda server_args: None


def eagle_kwargs(draft: str, topk=4, steps=3, n=8, algorithm=None, **extra) -> dict:
    """EAGLE / EAGLE3 arguments (``algorithm`` None: the one the draft's architecture needs); under EAGLE a
    ``token_map.pt`` in the draft directory is passed as the token map (an EAGLE-3 head carries its own ``d2t``:
    SGLang would warn and ignore one)."""
    if algorithm is None:
        from ...models import draft_arch
        from ...models.eagle3_head import EAGLE3_ARCH

        algorithm = "EAGLE3" if draft_arch(draft) == EAGLE3_ARCH else "EAGLE"
    kw = dict(speculative_algorithm=algorithm, speculative_draft_model_path=draft, speculative_eagle_topk=topk,
              speculative_num_steps=steps, speculative_num_draft_tokens=n, **extra)
    tmap = os.path.join(draft, "token_map.pt")
    if algorithm == "EAGLE" and os.path.isfile(tmap):
        kw["speculative_token_map"] = tmap
    return kw


def threads_bind(ranks: int, cores=None) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU ranks: the cores split into contiguous groups,
    one per rank (SGLang's CPU engine needs it for TP / DP > 1 on one NUMA node).

    >>> threads_bind(2, cores=[0, 1, 2, 3])
    '0,1|2,3'
    >>> threads_bind(2, cores=[0])  # fewer cores than ranks: ranks share
    '0|0'
    """
    cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    per = max(len(cores) // ranks, 1)
    groups = [cores[(i * per) % len(cores):(i * per) % len(cores) + per] for i in range(ranks)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


class EngineHost:
    """A running engine in a child process; ``generate(**kw)`` returns ``sgl.Engine.generate``'s result."""

    def __init__(self, name: str, engine_kwargs: dict, log_dir: str, cwd: str = None, env: dict = None):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        env = {**os.environ, **CPU_ENV, "PYTHONUNBUFFERED": "1", **(env or {})}
        ranks = int(engine_kwargs.get("tp_size", 1)) * int(engine_kwargs.get("dp_size", 1))
        if ranks > 1:  # SGLang's CPU engine binds each rank's OpenMP threads to its own cores
            env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", threads_bind(ranks))
        if cwd:
            env["PYTHONPATH"] = os.pathsep.join([cwd, os.environ.get("PYTHONPATH", "")])
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, json.dumps(engine_kwargs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=cwd)
        msg = self._read(START_TIMEOUT)
        if not msg["ok"]:
            self.close()
            raise RuntimeError(f"engine {name} failed to start: {msg['error']}\n{self.tail()}")
        self.start_seconds = msg["seconds"]
        self.request_seconds = []

    def tail(self, n=4000) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def _read(self, timeout: float) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine {self.name} exited:\n{self.tail()}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise TimeoutError(f"engine {self.name}: no answer in {timeout} s")

    def call(self, timeout: float = 900, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": "generate", "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        msg = self._read(timeout)
        self.request_seconds.append(msg["seconds"])
        return msg

    def method(self, name: str, timeout: float = 300):
        """Call an argument-free ``sgl.Engine`` method (``flush_cache``, ``get_server_info``)."""
        self.proc.stdin.write(json.dumps({"op": "call", "method": name}) + "\n")
        self.proc.stdin.flush()
        msg = self._read(timeout)
        if not msg["ok"]:
            raise RuntimeError(msg["error"])
        return msg["result"]

    def generate(self, **kwargs):
        msg = self.call(**kwargs)
        if not msg["ok"]:
            raise RuntimeError(msg["error"])
        return msg["result"]

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ------------------------------------------------------------------------------------ child side
def _reply(**kw):
    sys.stdout.write(MARK + json.dumps(kw) + "\n")
    sys.stdout.flush()


def main(argv=None):
    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    from . import install

    install()  # before sglang.srt is imported
    kwargs = json.loads((argv or sys.argv[1:])[0])
    defaults = kwargs.pop("treespec_defaults", None)
    overlap = kwargs.pop("treespec_overlap", False)
    import sglang as sgl

    if overlap:
        allow_cpu_overlap()
    from .. import configure

    if defaults:
        configure(defaults["policy"], defaults.get("config", {}), defaults.get("token_cap"))
    t = time.time()
    try:
        llm = sgl.Engine(**kwargs)
    except Exception as e:
        traceback.print_exc()
        _reply(ok=False, error=f"{type(e).__name__}: {e}", seconds=time.time() - t)
        return
    _reply(ok=True, result="started", seconds=time.time() - t)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "shutdown":
            break
        t = time.time()
        try:
            if msg["op"] == "call":
                if msg["method"] not in ("flush_cache", "get_server_info"):
                    raise ValueError(f"method must be flush_cache or get_server_info, got {msg['method']!r}")
                result = getattr(llm, msg["method"])()
                _reply(ok=True, result=result if msg["method"] == "get_server_info" else bool(result),
                       seconds=time.time() - t)
                continue
            _reply(ok=True, result=llm.generate(**msg["kwargs"]), seconds=time.time() - t)
        except Exception as e:
            traceback.print_exc()  # to the host's log
            _reply(ok=False, error=f"{type(e).__name__}: {e}", seconds=time.time() - t)
    llm.shutdown()
    _reply(ok=True, result="stopped", seconds=0.0)


if __name__ == "__main__":
    main()
