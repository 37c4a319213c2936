"""The streaming client against a small local stand-in of SGLang's ``/generate`` stream (cumulative chunks,
``meta_info`` per chunk, ``data: [DONE]``): timings, per-request failures, the concurrency cap."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from treespec_sglang.serverbench.client import flush_cache, run_requests, stream_generate

STEP = 0.05  # seconds between chunks
UNIT = 0.1  # the timed stream's unit (prompt [7]): (sleep in units, completion tokens) before each chunk
TIMED = [(1, 0), (2, 1), (3, 2), (1, 2), (2, 4)]  # chunks at .1 .3 .6 .7 .9 s; token-bearing: .3 .6 .9 s
TIMED_TAIL = 3  # units between the last chunk and [DONE] (the stream ends at 1.2 s)


class Fake(BaseHTTPRequestHandler):
    in_flight = 0
    max_in_flight = 0
    lock = threading.Lock()
    bodies = []

    def log_message(self, *a):
        pass

    flushes = 0

    def do_POST(self):
        if self.path.startswith("/flush_cache"):
            Fake.flushes += 1
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"Cache flushed.")
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Fake.bodies.append(body)
        kind = body["input_ids"][0]
        if kind == 400:
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"object": "error", "message": "custom_params[\'treespec\']: talon.mu must be in [0, 1]"}')
            return
        with Fake.lock:
            Fake.in_flight += 1
            Fake.max_in_flight = max(Fake.max_in_flight, Fake.in_flight)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            if kind == 7:
                self.timed_stream()
                return
            counts = [1, 1, 3, 4]  # a repeated count (a chunk with no new token) is not an ITL sample
            for i, n in enumerate(counts):
                time.sleep(STEP)
                if kind == 502 and i == 2:  # the server fails mid-stream: an error chunk, then the stream ends
                    self.send_chunk({"error": {"message": "scheduler died: CUDA out of memory", "code": 500}})
                    break
                meta = {"completion_tokens": n, "spec_verify_ct": i, "treespec_tree_sizes": [8] * i}
                if i == len(counts) - 1:
                    meta["finish_reason"] = ({"type": "abort", "message": "boom"} if kind == 500
                                             else {"type": "length", "length": 4})
                self.send_chunk({"text": "x" * n, "output_ids": list(range(10, 10 + n)), "meta_info": meta})
            self.wfile.write(b"data: [DONE]\n\n")
        finally:
            with Fake.lock:
                Fake.in_flight -= 1

    def send_chunk(self, chunk):
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()

    def timed_stream(self):
        for units, n in TIMED:
            time.sleep(units * UNIT)
            self.send_chunk({"text": "x" * n, "output_ids": list(range(n)), "meta_info": {"completion_tokens": n}})
        time.sleep(TIMED_TAIL * UNIT)
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def url():
    Fake.in_flight = Fake.max_in_flight = 0
    Fake.bodies = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_one_stream_is_timed_per_token_bearing_chunk(url):
    rec = stream_generate(url, 0, [1, 2], {"max_new_tokens": 4, "custom_params": {"treespec": {"policy": "c2t"}}})
    assert rec.ok and rec.error is None
    assert Fake.bodies[0] == {"input_ids": [1, 2], "stream": True,
                              "sampling_params": {"max_new_tokens": 4, "custom_params": {"treespec": {"policy": "c2t"}}}}
    assert rec.chunk_tokens == [1, 3, 4]  # the second chunk brought nothing new
    assert rec.output_ids == [10, 11, 12, 13] and rec.completion_tokens == 4
    assert rec.meta["treespec_tree_sizes"] == [8, 8, 8] and rec.meta["spec_verify_ct"] == 3
    assert STEP * 0.9 < rec.ttft < rec.latency
    assert len(rec.itl) == 2 and rec.itl[0] > 1.5 * STEP  # the gap spans the empty chunk


LATE = 0.25  # s: how late a measured time may be


def test_timings_are_the_servers_chunk_times(url):
    """A stream whose chunk times the server sets (prompt [7]: chunks at .1 .3 .6 .7 .9 s, the first
    without a token, the fourth without a new one, [DONE] at 1.2 s): TTFT is the first token-bearing chunk
    (.3 s), the gaps .3 .3 s, the latency the last token-bearing chunk (.9 s), not the stream's end. Each
    time is at least the server's sleeps and less than .25 s late (a loaded CI machine; the wrong formulas
    are .2-.3 s early or late at a bound that has no slack)."""
    rec = stream_generate(url, 0, [7], {"max_new_tokens": 4})
    assert rec.ok and rec.chunk_tokens == [1, 2, 4]
    want = [UNIT * sum(u for u, _ in TIMED[:k + 1]) for k in (1, 2, 4)]  # [.3, .6, .9] s
    for got, w in zip(rec.chunk_times, want):
        assert w - 1e-3 <= got < w + LATE, (rec.chunk_times, want)
    assert want[0] - 1e-3 <= rec.ttft < want[0] + LATE
    assert want[2] - 1e-3 <= rec.latency < want[2] + LATE
    for gap, w in zip(rec.itl, (want[1] - want[0], want[2] - want[1])):
        assert abs(gap - w) < LATE, rec.itl


def test_an_error_chunk_mid_stream_fails_the_request(url):
    """SGLang reports a failure inside a started stream as a chunk carrying "error": the request fails with
    that message (not ok, no timings), even though chunks with tokens came before it."""
    rec = stream_generate(url, 0, [502], {"max_new_tokens": 4})
    assert not rec.ok and rec.ttft is None and rec.latency is None
    assert rec.error.startswith("RuntimeError") and "scheduler died: CUDA out of memory" in rec.error


def test_failures_are_per_request_and_the_rest_run(url):
    prompts = [[1], [400], [2], [500], [3], [502]]
    done = []
    records, wall = run_requests(url, prompts, {"max_new_tokens": 4}, concurrency=2, on_done=done.append)
    assert [r.index for r in records] == [0, 1, 2, 3, 4, 5] and len(done) == 6
    assert [r.ok for r in records] == [True, False, True, False, True, False]
    assert "CUDA out of memory" in records[5].error
    assert records[1].error.startswith("HTTP 400") and "talon.mu must be in [0, 1]" in records[1].error
    assert records[3].error == "aborted: boom"
    assert wall > 0


@pytest.mark.parametrize("concurrency", [1, 3])
def test_concurrency_caps_requests_in_flight(url, concurrency):
    records, wall = run_requests(url, [[1]] * 6, {"max_new_tokens": 4}, concurrency=concurrency)
    assert all(r.ok for r in records)
    assert Fake.max_in_flight == concurrency
    assert wall >= (6 / concurrency) * 4 * STEP * 0.9


def test_an_interrupt_drops_the_queued_requests_instead_of_sending_them_first(url):
    """Ctrl-C (here: ``on_done`` raising it after the first request) leaves at once: the queued requests are
    never sent (leaving the executor's ``with`` waited for all of them, minutes with a real prompt set)."""
    Fake.bodies.clear()

    def interrupt(rec):
        raise KeyboardInterrupt

    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        run_requests(url, [[1]] * 10, {"max_new_tokens": 4}, concurrency=1, on_done=interrupt)
    assert time.perf_counter() - t0 < 3 * 4 * STEP  # the first request and at most one more, not ten
    time.sleep(4 * 4 * STEP)  # a request already in flight may still complete; nothing else is sent
    assert len(Fake.bodies) <= 2


def test_connection_refused_is_a_request_error():
    rec = stream_generate("http://127.0.0.1:9", 0, [1], {}, timeout=5)
    assert not rec.ok and "URLError" in rec.error


def test_flush_cache_hits_the_admin_route_and_reports_failures(url):
    Fake.flushes = 0
    assert flush_cache(url) is None and Fake.flushes == 1
    assert "URLError" in flush_cache("http://127.0.0.1:9", timeout=5)
