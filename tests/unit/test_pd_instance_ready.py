"""plugins/modules/pd_instance_ready.py: a restarted instance is waited for until /health answers 200, and a unit that
fails or is restarted by systemd while starting fails the wait at once, with its journal (issue #15: before, a
start that failed was noticed only after the whole 900 s readiness timeout)."""

from __future__ import annotations

import http.server
import threading

import pytest
from ansible_collections.b300.pd.tests.unit.pd_testlib import load_library, run_module

ready = load_library("pd_instance_ready")


class Health(http.server.BaseHTTPRequestHandler):
    status = 503
    # Answers to give first, one per GET, before `status` (counted, not timed: a timer raced the module's first poll
    # on two busy cores and the test saw 1 poll, CI-shaped run 2026-12-07).
    first: list = []
    served = 0

    def do_GET(self):  # noqa: N802 - the stdlib's name
        cls = type(self)
        cls.served += 1
        self.send_response(cls.first[cls.served - 1] if cls.served <= len(cls.first) else cls.status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture()
def health():
    handler = type("H", (Health,), {"status": 503, "first": [], "served": 0})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}/health"
    server.shutdown()


def systemd(states, journal="engine core died: CUDA error"):
    """A run_command that answers `systemctl show` from `states` (one per call, the last repeated) and journalctl."""
    calls = {"show": 0}

    def run_command(self, argv, **kw):
        if argv[0] == "journalctl":
            return 0, journal + "\n", ""
        i = min(calls["show"], len(states) - 1)
        calls["show"] += 1
        active, sub, restarts = states[i]
        return 0, f"ActiveState={active}\nSubState={sub}\nNRestarts={restarts}\n", ""

    return run_command, calls


def args(url, **kw):
    return dict({"unit": "vllm-decode-0.service", "url": url, "timeout_s": 30, "poll_s": 0.05}, **kw)


def test_ready_when_health_answers_200(health, monkeypatch):
    handler, url = health
    run_command, calls = systemd([("activating", "start", 0), ("active", "running", 0)])
    handler.first, handler.status = [503, 503], 200  # starting for two polls, then ready
    res, failed = run_module(ready.main, args(url), run_command=run_command, monkeypatch=monkeypatch)
    assert not failed, res["msg"]
    # Two polls of poll_s (0.05 s) apart before the third answered 200.
    assert res["polls"] == 3 and handler.served == 3 and 0.1 <= res["ready_s"] < 10, res
    assert res["unit_state"] == "active/running"


def test_a_failed_unit_fails_at_once_with_its_journal(health, monkeypatch):
    _handler, url = health
    run_command, calls = systemd([("activating", "start", 0), ("failed", "failed", 0)])
    res, failed = run_module(ready.main, args(url, timeout_s=900), run_command=run_command, monkeypatch=monkeypatch)
    assert failed
    assert "vllm-decode-0.service failed while starting (failed/failed" in res["msg"]
    assert "engine core died: CUDA error" in res["msg"]
    assert res["polls"] == 1  # not 900 s of polling


def test_a_crash_loop_fails_at_once(health, monkeypatch):
    _handler, url = health
    # systemd's Restart= brought the unit back after a crash: it looks "activating" again, NRestarts grew
    run_command, _calls = systemd([("activating", "start", 3), ("activating", "start", 3),
                                   ("activating", "auto-restart", 4)])
    res, failed = run_module(ready.main, args(url, timeout_s=900), run_command=run_command, monkeypatch=monkeypatch)
    assert failed and "was restarted by systemd 1 time(s)" in res["msg"]


def test_a_start_that_hangs_fails_at_the_timeout(health, monkeypatch):
    _handler, url = health
    run_command, _calls = systemd([("active", "running", 0)])
    res, failed = run_module(ready.main, args(url, timeout_s=1, poll_s=0.1), run_command=run_command,
                             monkeypatch=monkeypatch)
    assert failed and "did not answer 200 within 1 s" in res["msg"] and "active/running" in res["msg"]


def test_bad_arguments_are_refused(health, monkeypatch):
    _handler, url = health
    res, failed = run_module(ready.main, args(url, poll_s=0), monkeypatch=monkeypatch)
    assert failed and "poll_s > 0" in res["msg"]
