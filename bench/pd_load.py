#!/usr/bin/env python3
"""Steady load through the P/D router during a rolling upgrade or a fault test; counts every request. Stdlib only.

Keeps a stream of greedy completions going to an OpenAI-compatible URL (the router) until --duration elapses,
--max-requests were sent, SIGTERM/SIGINT arrives or --stop-file appears; then waits up to --grace for the
requests in flight and writes a JSON report (--out) plus a short summary. Exit 1 when more than --max-failed
requests failed (or fewer than --min-completed completed), 2 on bad arguments.

  python3 bench/pd_load.py --url http://10.237.0.13:8000 --model tiny-pd --concurrency 4 \
      --max-tokens 16 --prompt-words 64 --stop-file /tmp/pd_load.stop --out reports/pd_load.json

Load shapes: --concurrency N alone = N closed-loop workers (each sends its next request when the previous one
ends); --rate R = requests start on a fixed schedule of R per second (open loop), at most --concurrency (default
64) in flight: a request whose slot comes late is still sent, late, and counted in late_starts.

Every request is new TCP connection (no keep-alive: a restart of the router cannot turn a stale pooled
connection into a client-side failure), carries X-Request-Id pdload-<run>-<n> (grep the router/vLLM logs for
it) and ends in exactly one of: completed, or failed with one class (see FAILURE_CLASSES).

Library use (a pytest integration test around a playbook run):

    from ansible_collections.b300.pd.bench.pd_load import LoadGenerator
    gen = LoadGenerator(url="http://10.237.0.13:8000", model="tiny-pd", concurrency=2)
    gen.start()                 # returns at once; load runs in background threads
    run_a_change_through_site_yml()
    rep = gen.stop()            # stop sending, wait for in-flight (grace), final report dict
    assert rep["failed"] == 0 and rep["completed"] > 0, rep["failures"]

Runs on Python >= 3.9 (control venv, Debian bookworm's python3 on the test hosts); a single file, copy it anywhere.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from urllib.parse import urlsplit

SCHEMA = "pd_load/1"

FAILURE_CLASSES = {
    "http_<code>": "the server answered with an HTTP status other than 200 (http_503, http_500, http_404, ...)",
    "timeout": "no complete answer within --timeout (connect, headers or body; the deadline is per request)",
    "conn_refused": "TCP connection refused (nothing listens: the router or its port is down)",
    "conn_reset": "connection reset or closed before the response was complete (peer died or dropped it)",
    "conn_error": "other network error (no route to host, DNS, ...)",
    "protocol_error": "the answer is not valid HTTP",
    "empty_body": "HTTP 200 with an empty body (or a stream with no event)",
    "bad_body": "HTTP 200 whose body is not a completion: not JSON, an error object, no choices, stream cut "
                "before [DONE]",
    "short_output": "a completion with fewer tokens than --min-output-tokens (usage.completion_tokens; with no "
                    "usage block: an empty text)",
    "unfinished": "still in flight when the grace period after the stop ran out (never dropped silently)",
    "client_error": "an unexpected exception in this client (a bug: see error_samples)",
}

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud light north "
          "south green amber copper silver garden window market valley harbor signal").split()

_BODY_EXCERPT = 500  # characters of a failed request's body kept in error_samples
_LATE_START_S = 0.1  # a scheduled (--rate) request that starts later than this counts in late_starts
_TICK_S = 0.05  # supervisor poll period (stop file, duration, stop requests)


class ConfigError(ValueError):
    """Bad load-generator settings; the message names every bad field and the fix."""


def word_prompt(n_words: int, seed: int) -> str:
    """n_words random words (about 1.0-1.3 tokens each), reproducible from seed."""
    rng = random.Random(seed)  # noqa: S311 - reproducible filler text, not crypto
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n_words)))


def percentile(values, p: float):
    """Nearest-rank percentile (the smallest value with at least p % of the values <= it); None if empty."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100.0 * len(s)) - 1))]


def latency_stats(values) -> dict | None:
    """{count, min, mean, p50, p95, p99, max} in seconds (4 decimals), None when there is no value."""
    if not values:
        return None
    s = sorted(values)

    def r(x):
        return round(x, 4)

    return {"count": len(s), "min": r(s[0]), "mean": r(sum(s) / len(s)), "p50": r(percentile(s, 50)),
            "p95": r(percentile(s, 95)), "p99": r(percentile(s, 99)), "max": r(s[-1])}


# ------------------------------------------------------------------------------------------------ settings
@dataclass
class LoadConfig:
    """Settings of one run; field names are the CLI's long options with '-' -> '_'."""

    url: str = ""
    model: str = ""
    endpoint: str = "completions"  # completions | chat
    max_tokens: int = 16
    prompt_words: int = 64
    concurrency: int | None = None  # closed-loop workers; with rate: the cap on requests in flight
    rate: float | None = None  # requests per second (open loop)
    duration: float | None = None  # seconds; None or 0: until stop()/signal/stop file/max_requests
    max_requests: int | None = None
    timeout: float = 60.0  # per request, connect to last byte
    grace: float | None = None  # wait for in-flight after the stop; None: timeout + 5
    stream: bool = False
    ignore_eos: bool = True  # ignore_eos + min_tokens = max_tokens: every completion has max_tokens tokens
    min_output_tokens: int | None = None  # None: max_tokens with ignore_eos, else 1
    api_key: str | None = None
    stop_file: str | None = None
    seed: int = 0
    error_samples: int = 3  # kept per failure class
    bucket: float = 1.0  # timeline bucket width, seconds
    max_failed: int = 0
    min_completed: int = 1

    @property
    def workers(self) -> int:
        if self.concurrency:
            return self.concurrency
        return 64 if self.rate else 4

    @property
    def grace_s(self) -> float:
        return self.timeout + 5.0 if self.grace is None else self.grace

    @property
    def min_tokens_expected(self) -> int:
        if self.min_output_tokens is not None:
            return self.min_output_tokens
        return self.max_tokens if self.ignore_eos else 1

    def validate(self) -> None:
        """Raise ConfigError naming every bad field and the fix."""
        errs = []
        parts = urlsplit(self.url or "")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            errs.append(f"url '{self.url}': need http://HOST:PORT (the router, e.g. http://10.237.0.13:8000)")
        else:
            try:
                parts.port  # noqa: B018 - raises ValueError on a bad port
            except ValueError:
                errs.append(f"url '{self.url}': the port is not a number in 1-65535")
        if not self.model:
            errs.append("model: empty; give the served model name (pd_served_model_name, e.g. tiny-pd)")
        if self.endpoint not in ("completions", "chat"):
            errs.append(f"endpoint '{self.endpoint}': use completions or chat")
        for name in ("max_tokens", "prompt_words"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                errs.append(f"{name} {getattr(self, name)!r}: must be an integer >= 1")
        if self.concurrency is not None and (not isinstance(self.concurrency, int) or self.concurrency < 1):
            errs.append(f"concurrency {self.concurrency!r}: must be an integer >= 1")
        if self.rate is not None and not self.rate > 0:
            errs.append(f"rate {self.rate!r}: must be > 0 requests per second (leave it out for a closed loop)")
        if self.duration is not None and not self.duration >= 0:
            errs.append(f"duration {self.duration!r}: must be >= 0 seconds (0: until stopped)")
        if self.max_requests is not None and (not isinstance(self.max_requests, int) or self.max_requests < 1):
            errs.append(f"max_requests {self.max_requests!r}: must be an integer >= 1")
        if not self.bucket > 0:
            errs.append(f"bucket {self.bucket!r}: must be > 0 seconds (timeline bucket width)")
        if not self.timeout > 0:
            errs.append(f"timeout {self.timeout!r}: must be > 0 seconds")
        if self.grace is not None and not self.grace >= 0:
            errs.append(f"grace {self.grace!r}: must be >= 0 seconds")
        if self.min_output_tokens is not None and not 0 <= self.min_output_tokens <= self.max_tokens:
            errs.append(f"min_output_tokens {self.min_output_tokens!r}: must be between 0 and max_tokens "
                        f"({self.max_tokens})")
        for name in ("error_samples", "max_failed", "min_completed"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                errs.append(f"{name} {getattr(self, name)!r}: must be an integer >= 0")
        if self.stop_file and os.path.exists(self.stop_file):
            errs.append(f"stop_file {self.stop_file}: exists already (left by an earlier run?); remove it or "
                        "pick another path, else the run would stop at once")
        if errs:
            raise ConfigError("; ".join(errs))


# ------------------------------------------------------------------------------------------- one request
class _Failure(Exception):
    def __init__(self, cls, detail, status=None, body=""):
        super().__init__(detail)
        self.cls, self.detail, self.status, self.body = cls, detail, status, body


@dataclass
class _Outcome:
    ok: bool
    cls: str | None = None
    status: int | None = None
    detail: str = ""
    body: str = ""
    ttft: float | None = None
    tokens: int | None = None
    finish_reason: str | None = None
    has_text: bool = False


def _remaining(deadline: float) -> float:
    rem = deadline - time.monotonic()
    if rem <= 0:
        raise TimeoutError("per-request deadline passed")
    return rem


def _read1(resp, sock, deadline: float) -> bytes:
    """At most one socket read, bounded by the request deadline (a trickling server cannot stretch it)."""
    sock.settimeout(_remaining(deadline))
    return resp.read1(65536)


def _read_body(resp, sock, deadline: float, limit: int | None = None) -> bytes:
    buf = bytearray()
    while limit is None or len(buf) < limit:
        chunk = _read1(resp, sock, deadline)
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def _read_error_body(resp, sock, deadline: float) -> bytes:
    """The start of a non-200 answer's body; what arrived before a stall or a reset (the class stays http_<code>)."""
    buf = bytearray()
    try:
        while len(buf) < 4096:
            chunk = _read1(resp, sock, min(deadline, time.monotonic() + 2.0))
            if not chunk:
                break
            buf += chunk
    except (OSError, http.client.HTTPException):
        pass
    return bytes(buf)


def _excerpt(data) -> str:
    if isinstance(data, (bytes, bytearray)):
        data = data.decode("utf-8", "replace")
    return data[:_BODY_EXCERPT]


def _classify(exc: BaseException) -> tuple[str, str]:
    """An exception raised while talking to the server -> (failure class, detail)."""
    detail = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timeout", detail
    if isinstance(exc, ConnectionRefusedError):
        return "conn_refused", detail
    if isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, http.client.IncompleteRead,
                        http.client.RemoteDisconnected)):
        return "conn_reset", detail
    if isinstance(exc, http.client.HTTPException):
        return "protocol_error", detail
    if isinstance(exc, OSError):
        return "conn_error", detail
    return "client_error", detail


def _choice_text(choice: dict, chat: bool, delta: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    msg = choice.get("delta" if delta else "message") or {}
    # reasoning models (GLM) may put their first tokens in reasoning_content / reasoning, not content
    return msg.get("content") or msg.get("reasoning_content") or msg.get("reasoning") or ""


def _usage_tokens(obj: dict):
    usage = obj.get("usage") or {}
    tok = usage.get("completion_tokens")
    return tok if isinstance(tok, int) else None


# --------------------------------------------------------------------------------------------- generator
def client_api_key() -> str | None:
    """The front door's client key for the bench tools and tests, never from argv: $PD_LOAD_API_KEY, else the file
    $PD_API_KEY_FILE, else the local stack's key made by scripts/bootstrap (.cache/frontdoor/api-key)."""
    if os.environ.get("PD_LOAD_API_KEY"):
        return os.environ["PD_LOAD_API_KEY"]
    path = os.environ.get("PD_API_KEY_FILE") or str(Path(__file__).resolve().parents[1] / ".cache/frontdoor/api-key")
    try:
        return Path(path).read_text().strip() or None
    except FileNotFoundError:
        return None


class LoadGenerator:
    """Background load through the router; start() / stop() / report(), or run() to block until done.

    Keyword arguments are LoadConfig fields (or pass config=LoadConfig(...)). Bad settings raise ConfigError.
    """

    def __init__(self, config: LoadConfig | None = None, **kwargs):
        if config is None:
            config = LoadConfig(**kwargs)
        elif kwargs:
            config = LoadConfig(**{**asdict(config), **kwargs})
        config.validate()
        self.cfg = config
        parts = urlsplit(config.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[:-3]
        self._chat = config.endpoint == "chat"
        self._path = prefix + ("/v1/chat/completions" if self._chat else "/v1/completions")
        self.run_id = uuid.uuid4().hex[:8]

        self._lock = threading.Lock()
        self._abort = threading.Event()  # pending scheduled requests are not sent; set on a hard stop
        self._done = threading.Event()
        self._stop_req = None  # (reason, grace or None); plain assignment: safe from a signal handler
        self._threads: list[threading.Thread] = []
        self._supervisor: threading.Thread | None = None
        self._t0 = None  # monotonic start
        self._wall0 = None  # unix time of the start
        self._t_end = None
        self._issued = 0  # request numbers handed out
        self._hard_closed = False
        self._close_reason = None
        self._close_t = None
        self._in_flight_at_stop = None
        self._finalized = False
        self._inflight: dict[int, tuple[float, socket.socket | None]] = {}
        self._sent = 0
        self._completed = 0
        self._failed = 0
        self._failures: dict[str, int] = {}
        self._samples: dict[str, list] = {}
        self._latencies: list[float] = []
        self._ttfts: list[float] = []
        self._completion_ends: list[float] = []
        self._output_tokens = 0
        self._finish_reasons: dict[str, int] = {}
        self._late_starts = 0
        self._max_lag = 0.0
        self._fail_window = [None, None]  # first, last failure (end time, s after start)
        self._buckets: dict[int, dict] = {}

    # ----------------------------------------------------------------------------------- public API
    def start(self) -> LoadGenerator:
        """Start the workers and return at once."""
        if self._t0 is not None:
            raise RuntimeError("LoadGenerator.start(): already started (one run per instance)")
        self._t0 = time.monotonic()
        self._wall0 = time.time()
        for w in range(self.cfg.workers):
            t = threading.Thread(target=self._worker, name=f"pd_load-w{w}", daemon=True)
            self._threads.append(t)
            t.start()
        self._supervisor = threading.Thread(target=self._supervise, name="pd_load-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def request_stop(self, reason: str = "stop()", grace: float | None = None) -> None:
        """Ask the run to stop (no new request; wait for in-flight up to grace). Lock-free: safe in a signal
        handler. A later call keeps the first reason and may set the grace (grace=0: abandon the in-flight now)."""
        prev = self._stop_req
        self._stop_req = (prev[0] if prev else reason, grace if grace is not None else (prev[1] if prev else None))

    def stop(self, grace: float | None = None, reason: str = "stop()") -> dict:
        """Stop sending, wait for the in-flight requests (up to grace, default cfg.grace), return the report."""
        if self._t0 is None:
            raise RuntimeError("LoadGenerator.stop(): not started")
        self.request_stop(reason, grace)
        self._done.wait()
        return self.report()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run has ended on its own (duration, max_requests, stop file) or was stopped."""
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def stopping(self) -> bool:
        return self._stop_req is not None or self._close_reason is not None

    def run(self) -> dict:
        """start(), block until the run ends, return the report."""
        self.start()
        while not self._done.wait(0.2):
            pass
        return self.report()

    def __enter__(self) -> LoadGenerator:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self._t0 is not None and not self._done.is_set():
            self.stop()

    # ------------------------------------------------------------------------------------ scheduling
    def _close_locked(self, reason: str, hard: bool) -> None:
        if self._close_reason is None:
            self._close_reason = reason
            self._close_t = time.monotonic()
            self._in_flight_at_stop = len(self._inflight)
        if hard:
            self._hard_closed = True
            self._abort.set()

    def _take(self):
        """-> (request number, scheduled monotonic time) or None when no request is left to send."""
        cfg = self.cfg
        with self._lock:
            if self._hard_closed:
                return None
            i = self._issued
            if cfg.max_requests is not None and i >= cfg.max_requests:
                return None
            if cfg.rate:
                offset = i / cfg.rate
                if cfg.duration and offset >= cfg.duration - 1e-9:  # the schedule is rate x duration requests
                    return None
                sched = self._t0 + offset
            else:
                sched = time.monotonic()
                if cfg.duration and sched - self._t0 >= cfg.duration:
                    return None
            self._issued += 1
            return i, sched

    def _worker(self) -> None:
        while True:
            ticket = self._take()
            if ticket is None:
                return
            i, sched = ticket
            delay = sched - time.monotonic()
            if delay > 0 and self._abort.wait(delay):
                return
            if not self._begin(i, sched):
                return
            try:
                out = self._request(i)
            except Exception as e:  # noqa: BLE001 - a client bug is counted, never lost
                out = _Outcome(False, "client_error", detail=f"{type(e).__name__}: {e}")
            self._record(i, out)

    def _supervise(self) -> None:
        cfg = self.cfg
        try:
            while True:
                now = time.monotonic()
                req = self._stop_req
                with self._lock:
                    if req is not None:
                        self._close_locked(req[0], hard=True)
                    else:
                        if self._close_reason is None and cfg.duration and now - self._t0 >= cfg.duration:
                            self._close_locked("duration", hard=False)
                        if cfg.stop_file and not self._hard_closed and os.path.exists(cfg.stop_file):
                            self._close_locked("stop_file", hard=True)  # also cuts a --rate backlog short
                    close_t = self._close_t
                workers_alive = any(t.is_alive() for t in self._threads)
                if not workers_alive:
                    if self._close_reason is None:  # every worker ran out of requests on its own
                        with self._lock:
                            self._close_locked("max_requests" if cfg.max_requests else "duration", hard=False)
                    break
                if close_t is not None:
                    grace = req[1] if req is not None and req[1] is not None else cfg.grace_s
                    if now - close_t >= grace:
                        break
                time.sleep(_TICK_S)
        finally:
            self._finalize()

    # ------------------------------------------------------------------------------------- recording
    def _bucket(self, t: float) -> dict:
        idx = max(0, int((t - self._t0) / self.cfg.bucket))
        b = self._buckets.get(idx)
        if b is None:
            b = self._buckets[idx] = {"started": 0, "completed": 0, "failed": 0, "failures": {}, "lat": []}
        return b

    def _begin(self, i: int, sched: float) -> bool:
        now = time.monotonic()
        with self._lock:
            if self._hard_closed:
                return False
            self._sent += 1
            self._inflight[i] = (now, None)
            self._bucket(now)["started"] += 1
            mx = self.cfg.max_requests
            if mx is not None and self._sent >= mx:  # the last request has gone out: the stop moment
                self._close_locked("max_requests", hard=False)
            if self.cfg.rate:
                lag = now - sched
                self._max_lag = max(self._max_lag, lag)
                if lag > _LATE_START_S:
                    self._late_starts += 1
        return True

    def _set_sock(self, i: int, sock) -> None:
        with self._lock:
            if i in self._inflight:
                self._inflight[i] = (self._inflight[i][0], sock)

    def _fail_locked(self, cls: str, t_start: float, t_end: float, *, status=None, detail="", body="", rid=None):
        self._failed += 1
        self._failures[cls] = self._failures.get(cls, 0) + 1
        t_rel = round(t_end - self._t0, 3)
        if self._fail_window[0] is None:
            self._fail_window[0] = t_rel
        self._fail_window[1] = t_rel
        b = self._bucket(t_end)
        b["failed"] += 1
        b["failures"][cls] = b["failures"].get(cls, 0) + 1
        samples = self._samples.setdefault(cls, [])
        if len(samples) < self.cfg.error_samples:
            samples.append({"t_s": t_rel, "request_id": rid, "status": status,
                            "elapsed_s": round(t_end - t_start, 4), "detail": detail[:300], "body": body})

    def _record(self, i: int, out: _Outcome) -> None:
        now = time.monotonic()
        with self._lock:
            entry = self._inflight.pop(i, None)
            if self._finalized or entry is None:
                return  # already counted as unfinished
            t_start = entry[0]
            if out.ok:
                self._completed += 1
                lat = now - t_start
                self._latencies.append(lat)
                self._completion_ends.append(now - self._t0)
                if out.ttft is not None:
                    self._ttfts.append(out.ttft)
                self._output_tokens += out.tokens or 0
                fr = out.finish_reason or "none"
                self._finish_reasons[fr] = self._finish_reasons.get(fr, 0) + 1
                b = self._bucket(now)
                b["completed"] += 1
                b["lat"].append(lat)
            else:
                self._fail_locked(out.cls or "client_error", t_start, now, status=out.status, detail=out.detail,
                                  body=out.body, rid=self._rid(i))

    def _finalize(self) -> None:
        socks = []
        with self._lock:
            if self._finalized:
                return
            now = time.monotonic()
            if self._close_reason is None:
                self._close_locked("supervisor_error", hard=True)
            self._hard_closed = True
            self._abort.set()
            for i, (t_start, sock) in sorted(self._inflight.items()):
                self._fail_locked("unfinished", t_start, now, detail=f"still in flight {now - t_start:.1f} s after "
                                  f"start, grace {self._grace_used():.1f} s after the stop ran out", rid=self._rid(i))
                if sock is not None:
                    socks.append(sock)
            self._inflight.clear()
            self._finalized = True
            self._t_end = now
        for sock in socks:  # wake the abandoned workers; their late results are ignored
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._done.set()

    def _grace_used(self) -> float:
        req = self._stop_req
        return req[1] if req is not None and req[1] is not None else self.cfg.grace_s

    def _rid(self, i: int) -> str:
        return f"pdload-{self.run_id}-{i}"

    # -------------------------------------------------------------------------------------- the request
    def _payload(self, i: int) -> bytes:
        cfg = self.cfg
        prompt = word_prompt(cfg.prompt_words, cfg.seed * 1_000_003 + i)
        body: dict = {"model": cfg.model, "max_tokens": cfg.max_tokens, "temperature": 0.0}
        if self._chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if cfg.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = cfg.max_tokens
        if cfg.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return json.dumps(body).encode()

    def _headers(self, i: int) -> dict:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream" if self.cfg.stream else
             "application/json", "Connection": "close", "User-Agent": "pd_load/1", "X-Request-Id": self._rid(i)}
        if self.cfg.api_key:
            h["Authorization"] = f"Bearer {self.cfg.api_key}"
        return h

    def _request(self, i: int) -> _Outcome:
        cfg = self.cfg
        payload = self._payload(i)
        start = time.monotonic()
        deadline = start + cfg.timeout
        conn_cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = conn_cls(self._host, self._port, timeout=cfg.timeout)
        try:
            conn.connect()
            sock = conn.sock  # kept: http.client drops conn.sock once a Connection: close answer arrives
            self._set_sock(i, sock)
            sock.settimeout(_remaining(deadline))
            conn.request("POST", self._path, body=payload, headers=self._headers(i))
            sock.settimeout(_remaining(deadline))
            resp = conn.getresponse()
            if resp.status != 200:
                body = _read_error_body(resp, sock, deadline)
                raise _Failure(f"http_{resp.status}", f"HTTP {resp.status} {resp.reason}", resp.status,
                               _excerpt(body))
            if cfg.stream:
                out = self._read_stream(resp, sock, deadline, start)
            else:
                out = self._parse_json(_read_body(resp, sock, deadline))
            self._check_output(out)
            return out
        except _Failure as f:
            # a body failure is raised after an HTTP 200
            return _Outcome(False, f.cls, f.status if f.status is not None else 200, f.detail, f.body)
        except Exception as e:  # noqa: BLE001 - every exception is a classified failure
            cls, detail = _classify(e)
            return _Outcome(False, cls, detail=detail)
        finally:
            conn.close()

    def _parse_json(self, body: bytes) -> _Outcome:
        if not body.strip():
            raise _Failure("empty_body", "HTTP 200 with an empty body")
        try:
            obj = json.loads(body)
        except ValueError as e:
            raise _Failure("bad_body", f"body is not JSON: {e}", body=_excerpt(body)) from e
        if not isinstance(obj, dict) or obj.get("error") is not None:
            raise _Failure("bad_body", "body is an error object, not a completion", body=_excerpt(body))
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise _Failure("bad_body", "body has no choices", body=_excerpt(body))
        text = _choice_text(choices[0], self._chat, delta=False)
        return _Outcome(True, tokens=_usage_tokens(obj), finish_reason=choices[0].get("finish_reason"),
                        has_text=bool(text))

    def _read_stream(self, resp, sock, deadline: float, start: float) -> _Outcome:
        """SSE: data: {...} events until data: [DONE]; TTFT = first event with text."""
        buf = b""
        head = b""
        raw_bytes = 0
        events = 0
        ttft = None
        tokens = None
        finish = None
        text_len = 0
        done = False
        eof = False
        while not done and not eof:
            chunk = _read1(resp, sock, deadline)
            if not chunk:
                eof = True
                chunk = b"\n"  # flush a last line without newline
            else:
                raw_bytes += len(chunk)
                if len(head) < _BODY_EXCERPT:
                    head += chunk[:_BODY_EXCERPT - len(head)]
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                events += 1
                if data == b"[DONE]":
                    done = True
                    break
                try:
                    obj = json.loads(data)
                except ValueError as e:
                    raise _Failure("bad_body", f"stream event {events} is not JSON: {e}", body=_excerpt(data)) from e
                if not isinstance(obj, dict) or obj.get("error") is not None:
                    raise _Failure("bad_body", f"stream event {events} is an error", body=_excerpt(data))
                if _usage_tokens(obj) is not None:
                    tokens = _usage_tokens(obj)
                for ch in obj.get("choices") or []:
                    if not isinstance(ch, dict):
                        continue
                    piece = _choice_text(ch, self._chat, delta=True)
                    if piece:
                        text_len += len(piece)
                        if ttft is None:
                            ttft = time.monotonic() - start
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
        if not done:
            if raw_bytes == 0:
                raise _Failure("empty_body", "HTTP 200 stream closed with no byte")
            if events == 0:
                raise _Failure("bad_body", "HTTP 200 stream with no data: event", body=_excerpt(head))
            raise _Failure("bad_body", f"stream ended after {events} events without data: [DONE]")
        return _Outcome(True, ttft=ttft, tokens=tokens, finish_reason=finish, has_text=text_len > 0)

    def _check_output(self, out: _Outcome) -> None:
        want = self.cfg.min_tokens_expected
        if out.tokens is not None:
            if out.tokens < want:
                raise _Failure("short_output", f"{out.tokens} completion tokens, expected >= {want} "
                               f"(finish_reason {out.finish_reason})")
        elif want > 0 and not out.has_text:
            raise _Failure("short_output", f"empty text and no usage block (finish_reason {out.finish_reason})")

    # --------------------------------------------------------------------------------------- report
    def report(self) -> dict:
        """The report (final once done; a snapshot while running, with running: true)."""
        cfg = self.cfg
        if self._t0 is None:
            raise RuntimeError("LoadGenerator.report(): not started")
        with self._lock:
            now = self._t_end if self._finalized else time.monotonic()
            elapsed = now - self._t0
            send_s = (self._close_t if self._close_t is not None else now) - self._t0
            ends = list(self._completion_ends)
            gap, gap_at = 0.0, None
            for k in range(1, len(ends)):  # (no zip(strict=): runs on 3.9)
                if ends[k] - ends[k - 1] > gap:
                    gap, gap_at = ends[k] - ends[k - 1], ends[k - 1]
            timeline = []
            cum_started = cum_done = 0
            last = max(self._buckets) if self._buckets else -1
            last = max(last, int(elapsed / cfg.bucket) if self._finalized else last)
            for idx in range(last + 1):
                b = self._buckets.get(idx) or {"started": 0, "completed": 0, "failed": 0, "failures": {}, "lat": []}
                cum_started += b["started"]
                cum_done += b["completed"] + b["failed"]
                row = {"t": round(idx * cfg.bucket, 3), "started": b["started"], "completed": b["completed"],
                       "failed": b["failed"],
                       "in_flight": cum_started - cum_done,
                       "latency_p50_s": round(percentile(b["lat"], 50), 4) if b["lat"] else None,
                       "latency_max_s": round(max(b["lat"]), 4) if b["lat"] else None}
                if b["failures"]:
                    row["failures"] = dict(sorted(b["failures"].items()))
                timeline.append(row)
            failed = self._failed
            completed = self._completed
            fail_reasons = []
            if failed > cfg.max_failed:
                fail_reasons.append(f"failed {failed} > max_failed {cfg.max_failed}")
            if completed < cfg.min_completed:
                fail_reasons.append(f"completed {completed} < min_completed {cfg.min_completed}")
            settings = asdict(cfg)
            settings["api_key"] = "<set>" if cfg.api_key else None
            settings.update(workers=cfg.workers, grace_s=cfg.grace_s, min_output_tokens=cfg.min_tokens_expected,
                            path=self._path)
            rep = {
                "schema": SCHEMA,
                "run_id": self.run_id,
                "running": not self._finalized,
                "config": settings,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._wall0)),
                "started_at_unix": round(self._wall0, 3),
                "stop_reason": self._close_reason,
                "elapsed_s": round(elapsed, 3),
                "send_duration_s": round(send_s, 3),
                "sent": self._sent,
                "completed": completed,
                "failed": failed,
                "in_flight": len(self._inflight),
                "in_flight_at_stop": self._in_flight_at_stop,
                "unfinished": self._failures.get("unfinished", 0),
                "failures": dict(sorted(self._failures.items())),
                "first_failure_t_s": self._fail_window[0],
                "last_failure_t_s": self._fail_window[1],
                "error_samples": {k: list(v) for k, v in sorted(self._samples.items())},
                "latency_s": latency_stats(self._latencies),
                "ttft_s": latency_stats(self._ttfts),
                "throughput": {
                    "completed_req_s": round(completed / send_s, 4) if send_s > 0 else None,
                    "output_tok_s": round(self._output_tokens / send_s, 2) if send_s > 0 else None,
                },
                "output_tokens": self._output_tokens,
                "finish_reasons": dict(sorted(self._finish_reasons.items())),
                "late_starts": self._late_starts,
                "max_start_lag_s": round(self._max_lag, 4),
                "longest_completion_gap_s": {"gap_s": round(gap, 3),
                                             "from_t_s": round(gap_at, 3) if gap_at is not None else None},
                "timeline": timeline,
                "passed": not fail_reasons and self._finalized,
                "fail_reasons": fail_reasons,
            }
        return rep


# --------------------------------------------------------------------------------------------------- CLI
def summary(rep: dict) -> str:
    """A few lines for a human (and a CI log)."""
    fails = ", ".join(f"{k} {v}" for k, v in rep["failures"].items()) or "none"
    lines = [f"pd_load {rep['run_id']}: sent {rep['sent']}, completed {rep['completed']}, failed {rep['failed']} "
             f"({fails}); stop: {rep['stop_reason']}, in flight at stop {rep['in_flight_at_stop']}, "
             f"unfinished {rep['unfinished']}"]
    lat = rep["latency_s"]
    if lat:
        thr = rep["throughput"]
        lines.append(f"latency p50 {lat['p50']:.3f} s  p95 {lat['p95']:.3f} s  p99 {lat['p99']:.3f} s  "
                     f"max {lat['max']:.3f} s; {thr['completed_req_s']} req/s, {thr['output_tok_s']} tok/s "
                     f"over {rep['send_duration_s']} s")
    if rep["ttft_s"]:
        t = rep["ttft_s"]
        lines.append(f"ttft p50 {t['p50']:.3f} s  p95 {t['p95']:.3f} s  p99 {t['p99']:.3f} s  max {t['max']:.3f} s")
    gap = rep["longest_completion_gap_s"]
    if gap["from_t_s"] is not None:
        lines.append(f"longest gap between completions: {gap['gap_s']} s from t={gap['from_t_s']} s")
    if rep["late_starts"]:
        lines.append(f"late starts: {rep['late_starts']} (max lag {rep['max_start_lag_s']} s; the concurrency "
                     f"cap was reached)")
    bad = [r for r in rep["timeline"] if r["failed"]]
    if bad:
        lines.append(f"failures from t={rep['first_failure_t_s']} s to t={rep['last_failure_t_s']} s, in "
                     f"{len(bad)} timeline bucket(s) of {rep['config']['bucket']:g} s")
    for cls, samples in rep["error_samples"].items():
        s = samples[0]
        body = f": {s['body'][:160]!r}" if s["body"] else ""
        lines.append(f"  [{cls}] t={s['t_s']} s {s['request_id']}: {s['detail']}{body}")
    verdict = "PASS" if rep["passed"] else "FAIL (" + "; ".join(rep["fail_reasons"] or ["not finished"]) + ")"
    lines.append(verdict)
    return "\n".join(lines)


def progress_line(rep: dict) -> str:
    last = rep["timeline"][-2] if len(rep["timeline"]) >= 2 else None
    fails = " ".join(f"{k}={v}" for k, v in rep["failures"].items())
    lat = rep["latency_s"]
    tail = f" | last {rep['config']['bucket']:g}s: ok {last['completed']} failed {last['failed']}" if last else ""
    p50 = f" p50 {lat['p50']:.3f}s" if lat else ""
    return (f"[{rep['elapsed_s']:8.1f}s] sent {rep['sent']} ok {rep['completed']} failed {rep['failed']}"
            f"{' (' + fails + ')' if fails else ''} in-flight {rep['in_flight']}{p50}{tail}")


def write_json(path: str, rep: dict) -> None:
    """Atomic write (a reader never sees half a report)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(rep, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Exit: 0 passed, 1 failed > --max-failed or completed < --min-completed, 2 bad arguments. "
               "Failure classes: " + "; ".join(f"{k}: {v}" for k, v in FAILURE_CLASSES.items()))
    d = LoadConfig()
    ap.add_argument("--url", required=True, help="OpenAI-compatible base URL (the router), e.g. "
                    "http://10.237.0.13:8000")
    ap.add_argument("--model", required=True, help="served model name (pd_served_model_name)")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default=d.endpoint,
                    help="/v1/completions (default) or /v1/chat/completions")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens per request (default 16)")
    ap.add_argument("--prompt-words", type=int, default=d.prompt_words,
                    help="prompt length in words, ~1-1.3 tokens each (default 64)")
    ap.add_argument("--concurrency", type=int, help="closed-loop workers (default 4); with --rate: the cap on "
                    "requests in flight (default 64)")
    ap.add_argument("--rate", type=float, help="open loop: start R requests per second on a fixed schedule")
    ap.add_argument("--duration", type=float, help="seconds to send for; 0 or absent: until SIGTERM/SIGINT, "
                    "--stop-file or --max-requests")
    ap.add_argument("--max-requests", type=int, help="stop after sending this many requests")
    ap.add_argument("--stop-file", help="stop when this path appears (it must not exist at start)")
    ap.add_argument("--timeout", type=float, default=d.timeout, help="per-request deadline, connect to last "
                    "byte (default 60 s)")
    ap.add_argument("--grace", type=float, help="after the stop, wait this long for in-flight requests "
                    "(default timeout + 5 s); those still running then count as failed 'unfinished'")
    ap.add_argument("--stream", action="store_true", help="stream (SSE) and record TTFT")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="do not send ignore_eos/min_tokens (vLLM extensions); then min output is 1 token")
    ap.add_argument("--min-output-tokens", type=int, help="fewer completion tokens = failed short_output "
                    "(default: max-tokens, or 1 with --no-ignore-eos)")
    ap.add_argument("--api-key", default=client_api_key(),
                    help="Bearer token (default: $PD_LOAD_API_KEY, else the file $PD_API_KEY_FILE, else the local "
                    "stack's .cache/frontdoor/api-key; the env var or file keeps it out of ps)")
    ap.add_argument("--seed", type=int, default=d.seed, help="prompt seed (request n uses seed*1000003+n)")
    ap.add_argument("--error-samples", type=int, default=d.error_samples, help="failed requests kept per "
                    "failure class, with their body excerpt (default 3)")
    ap.add_argument("--max-failed", type=int, default=d.max_failed, help="exit 1 when failed > this (default 0)")
    ap.add_argument("--min-completed", type=int, default=d.min_completed,
                    help="exit 1 when completed < this (default 1: a run that completed nothing never passes)")
    ap.add_argument("--bucket", type=float, default=d.bucket, help="timeline bucket width in seconds "
                    "(default 1; e.g. 10 for an hour-long soak)")
    ap.add_argument("--out", help="write the JSON report here (rewritten with running: true at every progress "
                    "line, final at the end)")
    ap.add_argument("--progress", type=float, default=10.0, help="progress line on stderr every S seconds "
                    "(0: none; default 10)")
    ap.add_argument("--json", action="store_true", help="print the JSON report on stdout instead of the summary")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    names = {f.name for f in fields(LoadConfig)}
    try:
        gen = LoadGenerator(LoadConfig(**{k: v for k, v in vars(a).items() if k in names}))
    except ConfigError as e:
        print(f"pd_load: bad arguments: {e}", file=sys.stderr)
        return 2

    def on_signal(signum, _frame):
        name = signal.Signals(signum).name
        if gen.stopping:
            gen.request_stop(grace=0)
            print(f"pd_load: {name} again: abandoning the requests in flight (counted as unfinished)",
                  file=sys.stderr, flush=True)
        else:
            gen.request_stop(reason=f"signal:{name}")
            print(f"pd_load: {name}: stopping; waiting up to {gen.cfg.grace_s:g} s for the requests in flight "
                  f"({name} again to abandon them)", file=sys.stderr, flush=True)

    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, on_signal)
    try:
        gen.start()
        next_progress = time.monotonic() + a.progress if a.progress > 0 else None
        while not gen.wait(0.1):
            if next_progress is not None and time.monotonic() >= next_progress:
                next_progress += a.progress
                rep = gen.report()
                print(progress_line(rep), file=sys.stderr, flush=True)
                if a.out:
                    write_json(a.out, rep)
        rep = gen.report()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if a.out:
        write_json(a.out, rep)
    if a.json:
        print(json.dumps(rep, indent=2))
    else:
        print(summary(rep) + (f"\nreport: {a.out}" if a.out else ""), flush=True)
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
