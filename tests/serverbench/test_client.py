"""The streaming client against a small local stand-in of SGLang's ``/generate`` stream (cumulative chunks,
``meta_info`` per chunk, ``data: [DONE]``): timings, per-request failures, the concurrency cap."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from treespec_sglang.serverbench.client import flush_cache, run_requests, stream_generate

STEP = 0.05  # seconds between chunks


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
            counts = [1, 1, 3, 4]  # a repeated count (a chunk with no new token) is not an ITL sample
            for i, n in enumerate(counts):
                time.sleep(STEP)
                meta = {"completion_tokens": n, "spec_verify_ct": i, "treespec_tree_sizes": [8] * i}
                if i == len(counts) - 1:
                    meta["finish_reason"] = ({"type": "abort", "message": "boom"} if kind == 500
                                             else {"type": "length", "length": 4})
                chunk = {"text": "x" * n, "output_ids": list(range(10, 10 + n)), "meta_info": meta}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        finally:
            with Fake.lock:
                Fake.in_flight -= 1


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
    assert rec.latency == pytest.approx(rec.ttft + sum(rec.itl))


def test_failures_are_per_request_and_the_rest_run(url):
    prompts = [[1], [400], [2], [500], [3]]
    done = []
    records, wall = run_requests(url, prompts, {"max_new_tokens": 4}, concurrency=2, on_done=done.append)
    assert [r.index for r in records] == [0, 1, 2, 3, 4] and len(done) == 5
    assert [r.ok for r in records] == [True, False, True, False, True]
    assert records[1].error.startswith("HTTP 400") and "talon.mu must be in [0, 1]" in records[1].error
    assert records[3].error == "aborted: boom"
    assert wall > 0


@pytest.mark.parametrize("concurrency", [1, 3])
def test_concurrency_caps_requests_in_flight(url, concurrency):
    records, wall = run_requests(url, [[1]] * 6, {"max_new_tokens": 4}, concurrency=concurrency)
    assert all(r.ok for r in records)
    assert Fake.max_in_flight == concurrency
    assert wall >= (6 / concurrency) * 4 * STEP * 0.9


def test_connection_refused_is_a_request_error():
    rec = stream_generate("http://127.0.0.1:9", 0, [1], {}, timeout=5)
    assert not rec.ok and "URLError" in rec.error


def test_flush_cache_hits_the_admin_route_and_reports_failures(url):
    Fake.flushes = 0
    assert flush_cache(url) is None and Fake.flushes == 1
    assert "URLError" in flush_cache("http://127.0.0.1:9", timeout=5)
