"""Start / stop ``python -m sglang.launch_server`` for one server setting, or use a running server.

No sglang import here: the server is a child process (its own process group, stopped as a whole), and
everything else is HTTP. On a CPU (``device="cpu"``) the launch uses SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``, ``intel_amx`` attention, float32, no CUDA graphs) with the plugin's
``sgl_kernel`` stand-ins (README, "SGLang on a CPU machine").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import List, Optional

from .matrix import ServerSetting

__all__ = ["LaunchedServer", "get_json", "free_port", "launch_command", "CPU_ARGS"]

CPU_ARGS = ["--device", "cpu", "--attention-backend", "intel_amx", "--dtype", "float32", "--disable-cuda-graph", "--sleep-on-idle",
            "--max-total-tokens", "8192"]


# what uvicorn logs (and then serves nothing) when the HTTP port is taken
BIND_ERROR = "error while attempting to bind on address"
BIND_TRIES = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 30) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def launch_command(model: str, setting: ServerSetting, *, draft: Optional[str], token_map: Optional[str],
                   device: str, port: int, extra: List[str] = ()) -> List[str]:
    """The ``launch_server`` argv for one setting (the draft only for EAGLE settings). A local draft directory
    picks the algorithm: ``EAGLE3`` for an EAGLE-3 head (``LlamaForCausalLMEagle3``), else ``EAGLE``."""
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning"]
    if device == "cpu":
        args += CPU_ARGS
    if setting.algorithm == "EAGLE":
        if not draft:
            raise ValueError(f"server {setting.label} needs --draft (an EAGLE draft model path)")
        algorithm = "EAGLE"
        if os.path.isfile(os.path.join(draft, "config.json")):
            from ..models import draft_arch
            from ..models.eagle3_head import EAGLE3_ARCH

            algorithm = "EAGLE3" if draft_arch(draft) == EAGLE3_ARCH else "EAGLE"
        args += setting.launch_args(algorithm) + ["--speculative-draft-model-path", draft]
        if token_map:
            args += ["--speculative-token-map", token_map]
    return args + list(extra)


class LaunchedServer:
    """A ``launch_server`` child for one setting; ``with LaunchedServer(...) as url:`` waits for /health."""

    def __init__(self, argv: List[str], log_path: str, *, device: str, startup_timeout: float = 900,
                 env: Optional[dict] = None):
        self.argv, self.log_path, self.startup_timeout = list(argv), log_path, startup_timeout
        self.env = {**os.environ, **(env or {})}
        if device == "cpu":
            from ..plugin.cpu.host import CPU_ENV  # plain constants; imports nothing of sglang

            self.env.update(CPU_ENV)
        self.proc = None
        self.start_seconds = None
        self._log_from = 0  # where this start's part of the log begins

    @property
    def url(self) -> str:
        """The server's address, from its ``--port`` argument (changed when a start lost its port)."""
        return f"http://127.0.0.1:{self.argv[self.argv.index('--port') + 1]}"

    def __enter__(self) -> str:
        """Start the server and wait for /health. The port was free when :func:`free_port` chose it, but another
        socket may take it before the server binds (SGLang's own IPC ports come from the same ephemeral range):
        SGLang then logs the bind error and never answers (its warmup waits minutes, then it kills itself). That
        start is stopped at once and retried on a fresh port, up to :data:`BIND_TRIES` times."""
        t0 = time.time()
        for attempt in range(BIND_TRIES):
            self._spawn(append=attempt > 0)
            try:
                if self._wait_healthy(t0):
                    break
            except BaseException:
                self.stop()
                raise
            self.stop()
            self.argv[self.argv.index("--port") + 1] = str(free_port())
        else:
            raise RuntimeError(f"server could not bind its port in {BIND_TRIES} tries (another socket took each "
                               f"one first); log {self.log_path}")
        self.start_seconds = time.time() - t0
        return self.url

    def _spawn(self, append: bool) -> None:
        self.log = open(self.log_path, "a+" if append else "w+")
        if append:
            self.log.write(f"\n[treespec bench-server] the port was taken; restarting on {self.url}\n")
            self.log.flush()
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        self._log_from = self.log.tell()

    def _wait_healthy(self, t0: float) -> bool:
        """True once /health answers; False when this start lost its port (:data:`BIND_ERROR` in its log);
        raises when the server exits or the startup timeout passes."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} while starting; "
                                   f"log {self.log_path}:\n{self.tail()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5)
                return True
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.time() - t0 > self.startup_timeout:
                    raise TimeoutError(f"server not healthy after {self.startup_timeout:.0f} s; "
                                       f"log {self.log_path}:\n{self.tail()}") from None
            self.log.flush()
            with open(self.log_path) as f:
                f.seek(self._log_from)
                if BIND_ERROR in f.read():
                    return False
            time.sleep(1)

    def __exit__(self, *exc) -> None:
        self.stop()

    def tail(self, n: int = 3000) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def stop(self) -> None:
        """SIGTERM the whole process group (launcher, scheduler, detokenizer), SIGKILL after 60 s."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()
        self.proc = None


@contextlib.contextmanager
def stopped_by_signals(signals=(signal.SIGTERM, signal.SIGHUP)):
    """Inside, SIGTERM / SIGHUP raise ``SystemExit(128 + signal)`` in the main thread, so every ``with
    LaunchedServer`` unwinds and stops its server. A server runs in a session of its own (a terminal's signals
    never reach it), and Python's default SIGTERM ends the process without unwinding: ``timeout``, a cancelled
    CI job or a dropped ssh session left the server running (holding its GPU memory)."""
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    before = {sig: signal.signal(sig, _raise) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def setting_of(info: dict) -> ServerSetting:
    """The setting a running server reports in ``/get_server_info``."""
    algo = info.get("speculative_algorithm")
    if not algo or str(algo).upper() in ("NONE", "NULL"):
        return ServerSetting("none")
    if str(algo).upper() not in ("EAGLE", "EAGLE3"):
        raise ValueError(f"the server runs speculative_algorithm {algo!r}; the plugin's policies need EAGLE / EAGLE3")
    return ServerSetting("EAGLE", int(info["speculative_eagle_topk"]), int(info["speculative_num_steps"]),
                         int(info["speculative_num_draft_tokens"]))
