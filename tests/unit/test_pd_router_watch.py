"""roles/pd_router files/pd_router_workers.py `watch` (issue 31): a dead worker leaves the IGW router's rotation within
~1 s and comes back when healthy; a worker drained on purpose (`set --state`) is never put back.

The real vllm-router 0.1.17 (.cache/router-venv) in IGW mode in front of the stub workers of test_pd_router_workers.
The router alone (no watcher) keeps sending a dead prefill requests: IGW workers get its built-in health settings
(3 failed checks, and the test router checks every 60 s), and its P/D path does not retry.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from ansible_collections.b300.pd.tests.unit.test_pd_router_workers import (
    TOOL,
    Stub,
    call,
    complete,
    router,
    tool,
    wanted,
)


def kill(stub):
    stub.server.shutdown()
    stub.server.server_close()


def revive(stub):
    port = int(stub.url.rsplit(":", 1)[1])
    stub.server = ThreadingHTTPServer(("127.0.0.1", port), stub.server.RequestHandlerClass)
    threading.Thread(target=stub.server.serve_forever, daemon=True).start()


def registered(base):
    status, text = call("GET", base + "/workers")
    assert status == 200, text
    return {w["url"]: w["worker_type"] for w in json.loads(text)["workers"]}


def wait_for(predicate, timeout):
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    return None


@contextlib.contextmanager
def watcher(bases, workers_file, state, tmp_path):
    log = open(tmp_path / "watch.log", "w+", encoding="utf-8")  # noqa: SIM115 - closed below
    args = [sys.executable, str(TOOL)]
    for base in bases:
        args += ["--router", base]
    proc = subprocess.Popen([*args, "watch", "--workers", str(workers_file), "--state", str(state),
                             "--interval", "0.25", "--successes", "2"], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield log
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def events(log):
    log.flush()
    log.seek(0)
    return [json.loads(line) for line in log if line.startswith("{")]


def test_dead_prefill_leaves_at_once_and_returns_when_healthy_and_a_drain_is_kept(tmp_path):
    p0, p1, d0 = Stub("p0"), Stub("p1"), Stub("d0")
    pd = [(p0.url, "prefill"), (p1.url, "prefill"), (d0.url, "decode")]
    topology = tmp_path / "workers.json"
    topology.write_text(wanted(pd))
    state = tmp_path / "state" / "wanted.json"
    with router("--enable-igw") as a, router("--enable-igw") as b:
        for base in (a, b):
            rc, _out, err = tool(base, "set", "--workers", str(topology), "--state", str(state))
            assert rc == 0, err
        assert json.loads(state.read_text()) == json.loads(wanted(sorted(pd)))
        with watcher([a, b], topology, state, tmp_path) as log:
            assert {complete(a)[1] for _i in range(4)} == {"d0:decode-after-p0", "d0:decode-after-p1"}

            # kill -9 of a prefill: out of both routers' rotation within ~1 s, then no request fails.
            kill(p1)
            gone = [wait_for(lambda base=base: p1.url not in registered(base), 3.0) for base in (a, b)]
            assert all(g is not None and g < 1.0 for g in gone), gone
            results = [complete(base) for base in (a, b) for _i in range(10)]
            assert set(results) == {(200, "d0:decode-after-p0")}, results

            # Back when healthy (two good checks in a row), on both routers, as a prefill.
            revive(p1)
            back = [wait_for(lambda base=base: registered(base).get(p1.url) == "prefill", 5.0) for base in (a, b)]
            assert all(t is not None for t in back), back
            assert {complete(a)[1] for _i in range(6)} == {"d0:decode-after-p0", "d0:decode-after-p1"}

            # A drain through `set --state` (the change path) is never undone by the watcher.
            rc, _out, err = tool(a, "--router", b, "set", "--workers", "-", "--state", str(state),
                                 stdin=wanted([pd[0], pd[2]]))
            assert rc == 0, err
            time.sleep(1.5)  # six passes of the watcher, p1 healthy throughout
            assert p1.url not in registered(a) and p1.url not in registered(b)

            kinds = [(e["event"], e["url"]) for e in events(log) if e["event"] in ("removed", "put_back")]
            assert kinds.count(("removed", p1.url)) == 2 and kinds.count(("put_back", p1.url)) == 2, kinds
            assert all(e["event"] != "error" for e in events(log)), events(log)


def test_without_the_watcher_the_router_keeps_the_dead_prefill(tmp_path):
    """The reason for the watcher, checked on the real router: a dead IGW prefill stays registered and requests
    routed to it fail (HTTP 500) for as long as the router's own health checks take."""
    p0, p1, d0 = Stub("p0"), Stub("p1"), Stub("d0")
    pd = [(p0.url, "prefill"), (p1.url, "prefill"), (d0.url, "decode")]
    with router("--enable-igw", "--health-check-interval-secs", "1", "--health-failure-threshold", "1") as a:
        rc, _out, err = tool(a, "set", "--workers", "-", stdin=wanted(pd))
        assert rc == 0, err
        kill(p1)
        time.sleep(1.0)
        statuses = [complete(a)[0] for _i in range(6)]
        assert 500 in statuses and p1.url in registered(a)


def test_watch_refuses_bad_arguments():
    rc = subprocess.run([sys.executable, str(TOOL), "watch", "--workers", "x", "--successes", "0"],
                        capture_output=True, text=True, timeout=30, check=False)
    assert rc.returncode == 2 and "--successes must be >= 1" in rc.stderr
