"""bench/pd_load.py against a real local HTTP server that misbehaves on purpose.

The server (http.server in a thread, 127.0.0.1, random port) answers the k-th request it receives (k from 1)
as its `plan(k, req)` says: a good completion, an HTTP error, a dropped connection, an answer slower than the
client's timeout, a bad or empty body, a short output, a cut or unterminated stream, a trickle. Keyed on the
arrival number, the counts are exact whatever the client's concurrency. Nothing of the generator is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from ansible_collections.b300.pd.bench import pd_load
from ansible_collections.b300.pd.bench.pd_load_config import ConfigError
from ansible_collections.b300.pd.bench.pd_load_generator import LoadGenerator, latency_stats
from ansible_collections.b300.pd.roles.pd_verify.files.pd_verify import percentile

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "pd_load.py"


# ------------------------------------------------------------------------------------------ fake server
def _completion(req: dict, tokens: int | None = None, chat: bool = False, reasoning: bool = False) -> dict:
    n = req.get("max_tokens", 1) if tokens is None else tokens
    if chat:
        msg = {"role": "assistant", "content": None if reasoning else "w " * n}
        if reasoning:
            msg["reasoning_content"] = "thinking " * n
        choice = {"index": 0, "message": msg, "finish_reason": "length"}
    else:
        choice = {"index": 0, "text": "w " * n, "finish_reason": "length"}
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice],
            "usage": {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}}


class FakeServer:
    """OpenAI-ish server; plan(k, req) -> action name or (name, arg). req: {path, headers, body, t}."""

    def __init__(self, plan=None):
        self.plan = plan or (lambda k, req: "ok")
        self.lock = threading.Lock()
        self.count = 0
        self.requests: list[dict] = []
        self.release = threading.Event()  # held handlers give up when the test ends
        self.t_first = None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                now = time.monotonic()
                with outer.lock:
                    outer.count += 1
                    k = outer.count
                    if outer.t_first is None:
                        outer.t_first = now
                    req = {"k": k, "path": self.path, "headers": dict(self.headers), "body": body,
                           "t": now - outer.t_first}
                    outer.requests.append(req)
                action = outer.plan(k, req)
                name, arg = (action, None) if isinstance(action, str) else action
                self.close_connection = True
                getattr(outer, "_do_" + name)(self, req, arg)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self.httpd.handle_error = lambda request, client_address: None  # dropped sockets are on purpose
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def wait_arrivals(self, n, timeout=5.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.count >= n:
                return
            time.sleep(0.01)
        raise AssertionError(f"server saw {self.count} requests, expected {n}")

    # actions ------------------------------------------------------------------------------------
    @staticmethod
    def _json(h, status, obj):
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _do_ok(self, h, req, arg):
        chat = req["path"].endswith("/chat/completions")
        if req["body"].get("stream"):
            return self._do_stream(h, req, arg)
        self._json(h, 200, _completion(req["body"], chat=chat, reasoning=arg == "reasoning"))

    def _do_hold(self, h, req, seconds):  # answers well, but only after `seconds` (or when the test ends)
        self.release.wait(seconds)
        try:
            self._do_ok(h, req, None)
        except OSError:
            pass  # the client gave up

    def _do_status(self, h, req, code):  # code or (code, seconds to wait first)
        code, delay = code if isinstance(code, tuple) else (code, 0)
        if delay:
            time.sleep(delay)
        self._json(h, code, {"error": {"message": f"no healthy decode worker (k={req['k']})", "code": code}})

    def _do_shed(self, h, req, retry_after):  # the front door's 429; Retry-After: retry_after unless None
        data = json.dumps({"error": {"message": "too many requests in flight", "type": "rate_limit_exceeded",
                                     "param": None, "code": 429}}).encode()
        h.send_response(429)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        if retry_after is not None:
            h.send_header("Retry-After", retry_after)
        h.end_headers()
        h.wfile.write(data)

    def _do_drop(self, h, req, arg):
        h.connection.shutdown(socket.SHUT_RDWR)

    def _do_bad_json(self, h, req, arg):
        self._json(h, 200, b"<html>proxy says hi</html>")

    def _do_empty(self, h, req, arg):
        self._json(h, 200, b"")

    def _do_error_obj(self, h, req, arg):
        self._json(h, 200, {"error": {"message": "engine dead"}})

    def _do_short(self, h, req, arg):
        self._json(h, 200, _completion(req["body"], tokens=1))

    def _do_trickle(self, h, req, arg):  # Content-Length 1000, one byte every 50 ms
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", "1000")
        h.end_headers()
        try:
            for _chunk in range(1000):
                if self.release.wait(0.05):
                    return
                h.wfile.write(b" ")
        except OSError:
            pass

    def _do_stream(self, h, req, arg):
        """Chunked SSE like vLLM; arg: None (good), 'first_delay', 'cut', 'no_done', 'error_event'."""
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def chunk(data: bytes):
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

        def event(obj):
            chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

        n = req["body"]["max_tokens"]
        if arg == "first_delay":
            time.sleep(0.15)
        for j in range(n):
            if arg == "paced" and j:
                time.sleep(0.03)
            event({"choices": [{"index": 0, "text": "w ", "finish_reason": "length" if j == n - 1 else None}]})
            if arg == "cut" and j == 1:
                h.wfile.flush()
                h.connection.shutdown(socket.SHUT_RDWR)
                return
            if arg == "error_event" and j == 1:
                event({"error": {"message": "KV transfer failed", "code": 500}})
                event(b"[DONE]")
                chunk(b"")
                return
        event({"choices": [], "usage": {"prompt_tokens": 5 + len(req["body"].get("prompt", "").split()),
                                        "completion_tokens": n}})
        if arg != "no_done":
            event(b"[DONE]")
        chunk(b"")


@pytest.fixture
def server_factory():
    made = []

    def make(plan=None):
        s = FakeServer(plan)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _invariants(rep):
    """What must hold for every final report."""
    assert rep["running"] is False
    assert rep["sent"] == rep["completed"] + rep["failed"]
    assert sum(rep["failures"].values()) == rep["failed"]
    assert rep["in_flight"] == 0
    tl = rep["timeline"]
    width = rep["config"]["bucket"]
    assert [r["t"] for r in tl] == [round(i * width, 3) for i in range(len(tl))]
    assert sum(r["started"] for r in tl) == rep["sent"]
    assert sum(r["completed"] for r in tl) == rep["completed"]
    assert sum(r["failed"] for r in tl) == rep["failed"]
    if tl:
        assert tl[-1]["in_flight"] == 0
    lat = rep["latency_s"]
    assert (lat["count"] if lat else 0) == rep["completed"]
    for cls, samples in rep["error_samples"].items():
        assert cls in rep["failures"] and 1 <= len(samples) <= rep["config"]["error_samples"]


# --------------------------------------------------------------------------------------------- tests
def test_percentile_nearest_rank():
    vals = list(range(100, 0, -1))  # unsorted on purpose
    assert percentile(vals, 50) == 50
    assert percentile(vals, 95) == 95
    assert percentile(vals, 99) == 99
    assert percentile(vals, 100) == 100
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    st = latency_stats([0.4, 0.1, 0.3, 0.2])
    assert st == {"count": 4, "min": 0.1, "mean": 0.25, "p50": 0.2, "p95": 0.4, "p99": 0.4, "max": 0.4}
    assert latency_stats([]) is None


def test_all_good_closed_loop(server_factory):
    srv = server_factory()
    rep = LoadGenerator(url=srv.url, model="tiny-pd", concurrency=3, max_requests=30, max_tokens=8,
                        prompt_words=20, timeout=5).run()
    _invariants(rep)
    assert (rep["sent"], rep["completed"], rep["failed"], rep["failures"]) == (30, 30, 0, {})
    assert rep["stop_reason"] == "max_requests" and rep["unfinished"] == 0 and rep["passed"] is True
    assert rep["in_flight_at_stop"] <= 3
    assert rep["output_tokens"] == 30 * 8 and rep["finish_reasons"] == {"length": 30}
    assert rep["ttft_s"] is None and rep["error_samples"] == {}
    # what went on the wire: greedy, exact output length, one id per request, no key
    assert len(srv.requests) == 30
    ids = {r["headers"]["X-Request-Id"] for r in srv.requests}
    assert len(ids) == 30 and all(i.startswith(f"pdload-{rep['run_id']}-") for i in ids)
    for r in srv.requests:
        b = r["body"]
        assert r["path"] == "/v1/completions"
        assert (b["model"], b["max_tokens"], b["temperature"], b["ignore_eos"], b["min_tokens"]) == \
            ("tiny-pd", 8, 0.0, True, 8)
        assert len(b["prompt"].split()) == 20 and "stream" not in b
        assert "Authorization" not in r["headers"]
    assert len({r["body"]["prompt"] for r in srv.requests}) == 30  # a different prompt per request


def test_misbehaving_server_counts_exactly(server_factory):
    # timeout 1 s vs a 3 s hold: wide enough that a loaded machine does not turn a quick answer into a timeout
    actions = {1: ("status", 503), 2: "drop", 3: ("hold", 3.0), 4: "bad_json", 5: "empty", 6: "short",
               7: "error_obj", 0: "ok"}
    srv = server_factory(lambda k, req: actions[k % 8])
    rep = LoadGenerator(url=srv.url, model="m", concurrency=4, max_requests=32, max_tokens=4,
                        timeout=1.0, error_samples=2).run()
    _invariants(rep)
    assert rep["failures"] == {"http_503": 4, "conn_reset": 4, "timeout": 4, "bad_body": 8, "empty_body": 4,
                               "short_output": 4}
    assert (rep["sent"], rep["completed"], rep["failed"]) == (32, 4, 28)
    assert rep["passed"] is False and rep["fail_reasons"] == ["failed 28 > max_failed 0"]
    s503 = rep["error_samples"]["http_503"]
    assert len(s503) == 2 and s503[0]["status"] == 503 and "no healthy decode worker" in s503[0]["body"]
    assert all(0.95 <= s["elapsed_s"] < 2.5 for s in rep["error_samples"]["timeout"])
    assert "proxy says hi" in rep["error_samples"]["bad_body"][0]["body"] or \
        "engine dead" in rep["error_samples"]["bad_body"][0]["body"]
    assert "1 completion tokens, expected >= 4" in rep["error_samples"]["short_output"][0]["detail"]
    assert rep["error_samples"]["short_output"][0]["status"] == 200
    assert rep["latency_s"]["count"] == 4


def test_connection_refused():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rep = LoadGenerator(url=f"http://127.0.0.1:{port}", model="m", concurrency=1, max_requests=3,
                        timeout=2).run()
    _invariants(rep)
    assert rep["failures"] == {"conn_refused": 3} and rep["completed"] == 0
    assert rep["fail_reasons"] == ["failed 3 > max_failed 0", "completed 0 < min_completed 1"]


def test_trickling_body_hits_the_per_request_deadline(server_factory):
    srv = server_factory(lambda k, req: "trickle")
    t = time.monotonic()
    rep = LoadGenerator(url=srv.url, model="m", concurrency=1, max_requests=1, timeout=0.4).run()
    _invariants(rep)
    assert rep["failures"] == {"timeout": 1}
    # the deadline is per request, not per read: 1000 bytes at 50 ms would take 50 s
    assert rep["error_samples"]["timeout"][0]["elapsed_s"] < 2.0 and time.monotonic() - t < 3.0


def test_stream_ttft_and_stream_failures(server_factory):
    actions = {1: ("stream", "first_delay"), 2: ("stream", "cut"), 3: ("stream", "no_done"),
               0: ("stream", "error_event")}
    srv = server_factory(lambda k, req: actions[k % 4])
    rep = LoadGenerator(url=srv.url, model="m", concurrency=2, max_requests=8, max_tokens=5,
                        stream=True, timeout=3).run()
    _invariants(rep)
    assert rep["failures"] == {"conn_reset": 2, "bad_body": 4}
    assert rep["completed"] == 2 and rep["output_tokens"] == 10
    ttft, lat = rep["ttft_s"], rep["latency_s"]
    assert ttft["count"] == 2 and ttft["min"] >= 0.15 and ttft["max"] <= lat["max"]
    details = [s["detail"] for s in rep["error_samples"]["bad_body"]]
    assert any("without data: [DONE]" in d for d in details) or any("is an error" in d for d in details)
    assert all(r["body"]["stream"] is True and r["body"]["stream_options"] == {"include_usage": True}
               for r in srv.requests)


def test_stop_waits_for_in_flight_requests(server_factory):
    srv = server_factory(lambda k, req: ("hold", 0.5))
    gen = LoadGenerator(url=srv.url, model="m", concurrency=2, timeout=5).start()
    srv.wait_arrivals(2)
    rep = gen.stop()
    _invariants(rep)
    assert rep["stop_reason"] == "stop()" and rep["in_flight_at_stop"] == 2
    assert (rep["sent"], rep["completed"], rep["failed"], rep["unfinished"]) == (2, 2, 0, 0)
    assert rep["passed"] is True and rep["latency_s"]["min"] >= 0.45


def test_grace_expiry_counts_unfinished_as_failed(server_factory):
    srv = server_factory(lambda k, req: ("hold", 10))
    gen = LoadGenerator(url=srv.url, model="m", concurrency=2, timeout=20, grace=0.2).start()
    srv.wait_arrivals(2)
    t = time.monotonic()
    rep = gen.stop()
    assert time.monotonic() - t < 3.0  # not the 10 s hold nor the 20 s timeout
    _invariants(rep)
    assert (rep["sent"], rep["completed"], rep["failed"]) == (2, 0, 2)
    assert rep["failures"] == {"unfinished": 2} and rep["unfinished"] == 2 and rep["in_flight_at_stop"] == 2
    assert rep["passed"] is False
    assert gen.report() == rep  # late answers do not change a final report
    srv.release.set()


def test_stop_file(server_factory, tmp_path):
    srv = server_factory(lambda k, req: ("hold", 0.02))
    stop = tmp_path / "stop"
    gen = LoadGenerator(url=srv.url, model="m", concurrency=1, stop_file=str(stop), timeout=5).start()
    srv.wait_arrivals(3)
    stop.write_text("")
    assert gen.wait(5)
    rep = gen.report()
    _invariants(rep)
    assert rep["stop_reason"] == "stop_file" and rep["failed"] == 0 and rep["completed"] >= 3
    with pytest.raises(ConfigError, match=r"stop_file .* exists already"):
        LoadGenerator(url=srv.url, model="m", stop_file=str(stop))


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(ConfigError) as e:
        LoadGenerator(url="10.237.0.13:8000", model="", rate=0, concurrency=0, max_tokens=4,
                      min_output_tokens=9)
    msg = str(e.value)
    for part in ("url '10.237.0.13:8000': need http://HOST:PORT", "model: empty", "rate 0", "concurrency 0",
                 "min_output_tokens 9"):
        assert part in msg


def test_rate_schedule_sends_rate_times_duration(server_factory):
    srv = server_factory()
    rep = LoadGenerator(url=srv.url, model="m", rate=40, duration=0.5, concurrency=4, timeout=5).run()
    _invariants(rep)
    assert (rep["sent"], rep["completed"], rep["failed"]) == (20, 20, 0)
    assert rep["stop_reason"] == "duration"
    t = sorted(r["t"] for r in srv.requests)
    # Spread over the half second (last one due at 0.475 s), not one burst. Server-side arrival times: on a
    # loaded machine the first arrival can lag its schedule more than the last, so the lower bound is loose.
    assert 0.2 <= t[-1] - t[0] <= 1.5


def test_rate_late_starts_when_the_cap_is_reached(server_factory):
    srv = server_factory(lambda k, req: ("hold", 0.15))  # request n starts >= 0.15 n s, due at 0.02 n s
    rep = LoadGenerator(url=srv.url, model="m", rate=50, concurrency=1, max_requests=4, timeout=5).run()
    _invariants(rep)
    # requests 2-4 start >= 0.13 s late; the first is late only if its thread started > 0.1 s after start()
    assert rep["completed"] == 4 and 3 <= rep["late_starts"] <= 4 and rep["max_start_lag_s"] >= 0.39


def test_api_key_and_chat_with_reasoning_output(server_factory):
    def plan(k, req):
        if req["headers"].get("Authorization") != "Bearer sekrit":
            return ("status", 401)
        return ("ok", "reasoning") if k % 2 == 0 else "ok"

    srv = server_factory(plan)
    rep = LoadGenerator(url=srv.url + "/v1/", model="m", endpoint="chat", api_key="sekrit",
                        concurrency=2, max_requests=4, timeout=5).run()
    _invariants(rep)
    assert (rep["completed"], rep["failed"]) == (4, 0)
    assert {r["path"] for r in srv.requests} == {"/v1/chat/completions"}
    assert all(r["body"]["messages"][0]["role"] == "user" for r in srv.requests)
    assert "sekrit" not in json.dumps(rep) and rep["config"]["api_key"] == "<set>"
    rep = LoadGenerator(url=srv.url, model="m", endpoint="chat", concurrency=1, max_requests=2,
                        timeout=5).run()
    assert rep["failures"] == {"http_401": 2}


def test_timeline_shows_the_dip(server_factory):
    """Server 'restarting' (503) from 0.15 s to 1.35 s after the first request; with 0.5 s buckets the bucket
    [0.5, 1.0) lies in the dip with 0.35 s to spare on both sides (a loaded machine delays answers that much)."""
    def plan(k, req):
        return ("status", (503, 0.03)) if 0.15 <= req["t"] < 1.35 else ("hold", 0.03)

    srv = server_factory(plan)
    rep = LoadGenerator(url=srv.url, model="m", concurrency=2, duration=1.9, bucket=0.5, timeout=5,
                        max_failed=10**6).run()
    _invariants(rep)
    tl = rep["timeline"]
    assert [r["t"] for r in tl[:4]] == [0.0, 0.5, 1.0, 1.5]
    assert tl[0]["completed"] > 0
    assert tl[1]["completed"] == 0 and tl[1]["failed"] > 0 and tl[1]["failures"] == {"http_503": tl[1]["failed"]}
    assert any(r["completed"] for r in tl[2:])
    gap = rep["longest_completion_gap_s"]
    assert gap["gap_s"] >= 0.8 and 0.0 < gap["from_t_s"] <= 0.5
    assert 0.1 <= rep["first_failure_t_s"] < rep["last_failure_t_s"] <= 1.9
    assert rep["passed"] is True  # max_failed raised: the gate is the caller's


def test_cli_report_file_and_exit_codes(server_factory, tmp_path, capsys):
    srv = server_factory(lambda k, req: ("status", 503) if k == 2 else "ok")
    out = tmp_path / "r" / "load.json"
    args = ["--url", srv.url, "--model", "m", "--concurrency", "1", "--max-requests", "5", "--timeout", "5",
            "--progress", "0", "--out", str(out)]
    assert pd_load.main(args) == 1
    text = capsys.readouterr().out
    assert "failed 1 (http_503 1)" in text and "FAIL (failed 1 > max_failed 0)" in text
    rep = json.loads(out.read_text())
    assert rep["schema"] == "pd_load/1" and rep["failures"] == {"http_503": 1} and rep["completed"] == 4
    assert rep["first_failure_t_s"] == rep["last_failure_t_s"] == rep["error_samples"]["http_503"][0]["t_s"]
    for key in ("run_id", "config", "started_at", "stop_reason", "elapsed_s", "send_duration_s", "sent",
                "in_flight_at_stop", "unfinished", "error_samples", "latency_s", "ttft_s", "throughput",
                "timeline", "passed", "fail_reasons", "longest_completion_gap_s", "late_starts"):
        assert key in rep
    assert pd_load.main([*args, "--max-failed", "1"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert pd_load.main(["--url", "nope", "--model", "m"]) == 2
    assert "need http://HOST:PORT" in capsys.readouterr().err


def _start_cli(url, tmp_path):
    out = tmp_path / "sig.json"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--url", url, "--model", "m", "--concurrency", "2",
                             "--timeout", "30", "--progress", "0", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out


def test_cli_sigterm_waits_for_in_flight(server_factory, tmp_path):
    srv = server_factory(lambda k, req: ("hold", 0.3))
    proc, out = _start_cli(srv.url, tmp_path)
    try:
        srv.wait_arrivals(3, timeout=10)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout + stderr
    rep = json.loads(out.read_text())
    _invariants(rep)
    assert rep["stop_reason"] == "signal:SIGTERM" and rep["failed"] == 0 and rep["unfinished"] == 0
    assert rep["completed"] == rep["sent"] == srv.count and 1 <= rep["in_flight_at_stop"] <= 2
    assert "waiting up to 35 s" in stderr and "PASS" in stdout


def test_cli_second_signal_abandons_in_flight(server_factory, tmp_path):
    srv = server_factory(lambda k, req: ("hold", 20))
    proc, out = _start_cli(srv.url, tmp_path)
    try:
        srv.wait_arrivals(2, timeout=10)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stdout + stderr
    rep = json.loads(out.read_text())
    _invariants(rep)
    assert rep["stop_reason"] == "signal:SIGINT" and rep["failures"] == {"unfinished": 2}
    assert "abandoning" in stderr and "FAIL" in stdout
    assert not os.path.exists(str(out) + f".tmp{proc.pid}")


def test_shed_retry_after_tpot_and_prompt_tokens(server_factory):
    """429s with and without Retry-After, their latency per class; TPOT and prompt tokens of streamed completions."""
    actions = {1: ("shed", "1"), 2: ("shed", None), 3: ("stream", "paced"), 0: ("status", 503)}
    srv = server_factory(lambda k, req: actions[k % 4])
    rep = LoadGenerator(url=srv.url, model="m", concurrency=2, max_requests=12, max_tokens=5, prompt_words=7,
                        stream=True, timeout=5, max_failed=100).run()
    _invariants(rep)
    assert rep["failures"] == {"http_429": 6, "http_503": 3} and rep["completed"] == 3
    assert rep["retry_after_missing"] == 3  # the 429s of k % 4 == 2
    fl = rep["failure_latency_s"]
    assert set(fl) == {"http_429", "http_503"} and fl["http_429"]["count"] == 6 and fl["http_503"]["count"] == 3
    assert fl["http_429"]["p99"] < 1.0
    # 5 tokens, 30 ms apart after the first: (latency - ttft) / 4 ~ 30 ms
    tpot = rep["tpot_s"]
    assert tpot["count"] == 3 and 0.025 <= tpot["min"] and tpot["max"] < 0.2
    assert rep["prompt_tokens"]["count"] == 3 and rep["prompt_tokens"]["mean"] == 12  # 5 + 7 words
    # the existing keys are unchanged
    assert rep["ttft_s"]["count"] == 3 and rep["latency_s"]["count"] == 3


def test_non_stream_prompt_tokens_and_no_tpot(server_factory):
    srv = server_factory(lambda k, req: "ok" if k % 2 else ("shed", "2"))
    rep = LoadGenerator(url=srv.url, model="m", concurrency=1, max_requests=4, max_tokens=3, timeout=5,
                        max_failed=100).run()
    _invariants(rep)
    assert rep["failures"] == {"http_429": 2} and rep["retry_after_missing"] == 0
    assert rep["prompt_tokens"]["mean"] == 10 and rep["tpot_s"] is None and rep["ttft_s"] is None
    assert list(rep["failure_latency_s"]) == ["http_429"]


def test_client_api_key_index(monkeypatch, tmp_path):
    from ansible_collections.b300.pd.bench.pd_load_config import client_api_key

    for var in ("PD_LOAD_API_KEY", "PD_API_KEY_FILE", "PD_LOAD_API_KEY_2", "PD_API_KEY_FILE_2"):
        monkeypatch.delenv(var, raising=False)
    f1, f2 = tmp_path / "k1", tmp_path / "k2"
    f1.write_text("one\n")
    f2.write_text("two\n")
    monkeypatch.setenv("PD_API_KEY_FILE", str(f1))
    monkeypatch.setenv("PD_API_KEY_FILE_2", str(f2))
    assert (client_api_key(), client_api_key(1), client_api_key(index=2)) == ("one", "one", "two")
    monkeypatch.setenv("PD_LOAD_API_KEY_2", "env-two")
    assert client_api_key(2) == "env-two" and client_api_key() == "one"
    monkeypatch.setenv("PD_LOAD_API_KEY", "env-one")
    assert client_api_key() == "env-one" and client_api_key(2) == "env-two"
    monkeypatch.delenv("PD_LOAD_API_KEY_2")
    monkeypatch.setenv("PD_API_KEY_FILE_2", str(tmp_path / "absent"))
    assert client_api_key(2) is None
    monkeypatch.delenv("PD_API_KEY_FILE_2")  # default: <repo>/.cache/frontdoor/api-key-2
    default = ROOT / ".cache" / "frontdoor" / "api-key-2"
    expect = default.read_text().strip() or None if default.exists() else None
    assert client_api_key(2) == expect
    with pytest.raises(ValueError, match="integer >= 1"):
        client_api_key(0)
