"""pd_load's load generator: a steady stream of requests through the router in background threads (closed loop, or
open loop at a fixed rate), every request accounted for, and the run's report (counts, failure classes, latencies,
timeline)."""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict

from ansible_collections.b300.pd.bench.pd_load_config import LoadConfig
from ansible_collections.b300.pd.bench.pd_load_request import CompletionClient, Outcome
from ansible_collections.b300.pd.roles.pd_verify.files.pd_verify import percentile

SCHEMA = "pd_load/1"

_LATE_START_S = 0.1  # a scheduled (--rate) request that starts later than this counts in late_starts
_TICK_S = 0.05  # supervisor poll period (stop file, duration, stop requests)


def latency_stats(values) -> dict | None:
    """{count, min, mean, p50, p95, p99, max} in seconds (4 decimals), None when there is no value."""
    if not values:
        return None
    s = sorted(values)

    def r(x):
        return round(x, 4)

    return {"count": len(s), "min": r(s[0]), "mean": r(sum(s) / len(s)), "p50": r(percentile(s, 50)),
            "p95": r(percentile(s, 95)), "p99": r(percentile(s, 99)), "max": r(s[-1])}


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
        self._client = CompletionClient(config)
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
        self._tpots: list[float] = []  # (latency - ttft) / (tokens - 1) of streamed completions, seconds
        self._prompt_tokens: list[int] = []
        self._fail_lat: dict[str, list[float]] = {}  # failure class -> elapsed of each such failure
        self._retry_after_missing = 0  # http_429 answers without a Retry-After header
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
                out = self._client.send(i, self._rid(i), functools.partial(self._set_sock, i))
            except Exception as e:  # noqa: BLE001 - a client bug is counted, never lost
                out = Outcome(False, "client_error", detail=f"{type(e).__name__}: {e}")
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

    def _fail_locked(self, cls: str, t_start: float, t_end: float, *, status=None, detail="", body="", rid=None,
                     retry_after=None):
        self._failed += 1
        self._failures[cls] = self._failures.get(cls, 0) + 1
        self._fail_lat.setdefault(cls, []).append(t_end - t_start)
        if cls == "http_429" and not retry_after:
            self._retry_after_missing += 1
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

    def _record(self, i: int, out: Outcome) -> None:
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
                    if out.tokens is not None and out.tokens > 1:
                        self._tpots.append(max(0.0, lat - out.ttft) / (out.tokens - 1))
                if out.prompt_tokens is not None:
                    self._prompt_tokens.append(out.prompt_tokens)
                self._output_tokens += out.tokens or 0
                fr = out.finish_reason or "none"
                self._finish_reasons[fr] = self._finish_reasons.get(fr, 0) + 1
                b = self._bucket(now)
                b["completed"] += 1
                b["lat"].append(lat)
            else:
                self._fail_locked(out.cls or "client_error", t_start, now, status=out.status, detail=out.detail,
                                  body=out.body, rid=self._rid(i), retry_after=out.retry_after)

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
                            path=self._client.path)
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
                "tpot_s": latency_stats(self._tpots),
                "prompt_tokens": latency_stats(self._prompt_tokens),
                "failure_latency_s": {k: latency_stats(v) for k, v in sorted(self._fail_lat.items())},
                "retry_after_missing": self._retry_after_missing,
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
