"""LaunchedServer against stand-in server processes (no sglang): a start whose port another socket took first is
retried on a fresh port instead of waiting out SGLang's warmup."""

import sys
import time

import pytest

from treespec_sglang.serverbench.server import BIND_ERROR, BIND_TRIES, LaunchedServer, free_port

# a stand-in for launch_server: the first `clashes` starts log uvicorn's bind error and hang (as SGLang does: its
# warmup waits on a port it does not hold), later ones answer /health
STAND_IN = r"""
import http.server, os, sys, time
port, count, clashes = int(sys.argv[sys.argv.index("--port") + 1]), sys.argv[1], int(sys.argv[2])
n = len(open(count).read()) if os.path.exists(count) else 0
open(count, "a").write("x")
if n < clashes:
    print(f"ERROR:    [Errno 98] {BIND} ('127.0.0.1', {port}): address already in use", flush=True)
    time.sleep(300)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""".replace("{BIND}", BIND_ERROR)


def stand_in(tmp_path, clashes):
    port = free_port()
    argv = [sys.executable, "-c", STAND_IN, str(tmp_path / "starts"), str(clashes), "--port", str(port)]
    return LaunchedServer(argv, str(tmp_path / "server.log"), device="cuda", startup_timeout=60), argv, port


@pytest.mark.parametrize("clashes", [0, 1, BIND_TRIES - 1])
def test_a_start_that_lost_its_port_is_retried_on_a_fresh_one(tmp_path, clashes):
    server, argv, port = stand_in(tmp_path, clashes)
    with server as url:
        assert (url == f"http://127.0.0.1:{port}") == (clashes == 0)
        assert len((tmp_path / "starts").read_text()) == clashes + 1
        log = (tmp_path / "server.log").read_text()
        assert log.count("the port was taken; restarting") == clashes and log.count(BIND_ERROR) == clashes
    assert argv[-1] == str(port)  # the caller's argv is left as it was
    assert server.proc is None  # stopped on exit


def test_a_server_that_never_gets_a_port_is_refused_after_the_tries(tmp_path):
    server, _, _ = stand_in(tmp_path, BIND_TRIES)
    with pytest.raises(RuntimeError, match=f"could not bind its port in {BIND_TRIES} tries"):
        with server:
            pass
    assert len((tmp_path / "starts").read_text()) == BIND_TRIES and server.proc is None


# a driver as bench-server runs one: the stand-in server started inside stopped_by_signals, its pid printed
DRIVER = r"""
import sys, time
from treespec_sglang.serverbench.server import LaunchedServer, stopped_by_signals
server = LaunchedServer(sys.argv[2:], sys.argv[1], device="cuda", startup_timeout=60)
with stopped_by_signals(), server:
    print(server.proc.pid, flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_signal_to_the_driver_stops_the_server_it_launched(tmp_path, sig):
    """The server runs in a session of its own (a terminal's signals never reach it) and Python's default
    SIGTERM does not unwind ``with``: ``timeout``, a cancelled CI job or a dropped ssh session left it running."""
    import os
    import signal
    import subprocess

    _, argv, _ = stand_in(tmp_path, 0)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "driver.log"), *argv],
                              stdout=subprocess.PIPE, text=True)
    server_pid = int(driver.stdout.readline())
    driver.send_signal(getattr(signal, sig))
    assert driver.wait(timeout=90) == 128 + getattr(signal, sig)
    with pytest.raises(ProcessLookupError):  # the server's process group is gone
        for _ in range(100):
            os.killpg(server_pid, 0)
            time.sleep(0.1)
