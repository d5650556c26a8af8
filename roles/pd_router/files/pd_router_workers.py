#!/usr/bin/env python3
"""Read and change vllm-router's worker registry (IGW mode, ``--enable-igw``). Stdlib only.

vllm-router 0.1.17 in ``--vllm-pd-disaggregation`` mode can remove a worker at runtime but never add one back
(``POST /add_worker`` and ``POST /workers`` answer 400 "PD router requires specific add_prefill_server or
add_decode_server methods"). In IGW mode the registry is dynamic: ``POST /workers {url, worker_type, model_id}``
adds a worker, or changes the type of a registered URL in place; ``DELETE /workers/<url>`` removes it. A model's
requests go to the P/D router while any prefill/decode worker of that model is registered, and to the regular
(colocated) router otherwise. docs/upgrades.md has the measurements.

  pd-router-workers [--router URL ...] list
  pd-router-workers [--router URL ...] set --workers FILE|- [--wait S] [--dry-run] [--state FILE]
  pd-router-workers [--router URL ...] watch --workers FILE [--state FILE] [--interval S] [--successes N]

``--router`` may be given once per P/D router (a front door sends requests to all of them): ``set`` changes each
router in turn, ``list`` reads each; the report then has one entry per router under ``routers`` and the combined
``changed`` / ``ops`` / ``window_ms`` (the longest window of any router).

``set`` makes the registry equal the wanted list (JSON: [{"url", "worker_type", "model_id"}, ...]): it orders the
changes so that the fewest intermediate states leave a model without a routable set (a P/D set with a prefill
and a decode worker, or regular workers), applies them back to back on one connection, and prints a JSON
report (changes, broken intermediate states, how long the model had no routable set). A model whose registry
changes from P/D to regular (or back) always passes through one such state: the router has no atomic swap.

``watch`` takes a dead worker out of every router at once and puts it back when it is healthy again. vllm-router
0.1.17 gives workers registered through ``POST /workers`` its built-in health settings (3 failed checks; the
--health-* flags reach only workers named on the command line, which IGW mode ignores), and its P/D path neither
retries nor feeds the circuit breaker: a dead prefill kept getting requests for ~3 s (measured). Each
``--interval`` the watcher connects to every registered worker; a refused connection (nothing listens: the
process is gone) is a removal at once (``DELETE``). A timeout is not: a busy worker is the routers' health
checks' business. A worker of the wanted list that is not registered goes back (``POST``) after ``--successes``
consecutive ``GET /health`` 200s. The wanted list is what the last ``set --state FILE`` applied (the change
path's drains), else the topology (``--workers``): a worker drained on purpose is never put back. ``set --state``
and the watcher's re-add hold the state file's lock (flock), so a drain and a re-add never interleave. The
watcher prints one JSON line per change (the journal).

Exit codes: 0 done, 1 router error, 2 bad input, 3 router not in IGW mode.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import http.client
import json
import os
import socket
import sys
import time
from urllib.parse import quote, urlsplit

TYPES = ("prefill", "decode", "regular")
PD_TYPES = ("prefill", "decode")
EXACT_SEARCH_MAX_OPS = 14  # 2**14 subsets; beyond that changes go in the simple order (puts, then deletes)


class RouterError(RuntimeError):
    """The router refused or could not be reached."""


class NotIgwError(RouterError):
    """The router runs without --enable-igw: its worker set cannot be changed at runtime."""


def routable(registry):
    """Per model: True when requests of that model have somewhere to go.

    ``registry``: {url: (worker_type, model_id)}. A model with any prefill/decode worker is routed by the P/D
    router, which needs both; a model with only regular workers by the regular router.
    """
    by_model = {}
    for wtype, model in registry.values():
        by_model.setdefault(model, set()).add(wtype)
    out = {}
    for model, types in by_model.items():
        if types & set(PD_TYPES):
            out[model] = {"prefill", "decode"} <= types
        else:
            out[model] = "regular" in types
    return out


def _broken_models(registry, models):
    ok = routable(registry)
    return sorted(m for m in models if not ok.get(m, False))


def diff(current, wanted):
    """Changes from ``current`` to ``wanted`` ({url: (type, model)}): ("put", url, type, model) or ("delete", url)."""
    ops = []
    for url in sorted(set(current) | set(wanted)):
        if url in wanted and current.get(url) != wanted[url]:
            ops.append(("put", url, *wanted[url]))
        elif url in current and url not in wanted:
            ops.append(("delete", url))
    return ops


def _apply(registry, op):
    reg = dict(registry)
    if op[0] == "put":
        reg[op[1]] = (op[2], op[3])
    else:
        reg.pop(op[1], None)
    return reg


def plan(current, wanted):
    """Order the changes; returns (ops, broken): broken = intermediate states that leave a model unroutable.

    Models considered: those of ``wanted`` that are routable there (a model being removed entirely does not
    count). Exhaustive over subsets up to EXACT_SEARCH_MAX_OPS changes: fewest broken states first, then puts
    before deletes (capacity stays in rotation as long as possible).
    """
    ops = diff(current, wanted)
    models = [m for m, ok in routable(wanted).items() if ok]
    if not ops:
        return [], 0
    if len(ops) > EXACT_SEARCH_MAX_OPS:
        ordered = [o for o in ops if o[0] == "put"] + [o for o in ops if o[0] == "delete"]
        return ordered, _count_broken(current, ordered, models)
    n = len(ops)
    full = (1 << n) - 1
    # best[mask] = (broken, late_puts, order); late_puts counts puts applied after some delete.
    best = {0: (0, 0, ())}
    for size in range(n):
        for mask in [m for m in best if bin(m).count("1") == size]:
            broken, late, order = best[mask]
            reg = current
            for i in order:
                reg = _apply(reg, ops[i])
            deleted = any(ops[i][0] == "delete" for i in order)
            for i in range(n):
                if mask & (1 << i):
                    continue
                nmask = mask | (1 << i)
                nreg = _apply(reg, ops[i])
                nb = broken + (1 if nmask != full and _broken_models(nreg, models) else 0)
                nl = late + (1 if ops[i][0] == "put" and deleted else 0)
                cand = (nb, nl, (*order, i))
                if nmask not in best or cand[:2] < best[nmask][:2]:
                    best[nmask] = cand
    broken, _late, order = best[full]
    return [ops[i] for i in order], broken


def _count_broken(current, ordered, models):
    reg, broken = current, 0
    for op in ordered[:-1]:
        reg = _apply(reg, op)
        broken += 1 if _broken_models(reg, models) else 0
    return broken


def parse_wanted(items, default_model=None):
    """Validate the wanted list; returns {url: (type, model)}."""
    if not isinstance(items, list):
        raise ValueError("the workers file must hold a JSON list of {url, worker_type, model_id}")
    out = {}
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"entry {i}: not an object")
        url, wtype = item.get("url"), item.get("worker_type")
        model = item.get("model_id") or default_model
        parts = urlsplit(url or "")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"entry {i}: url {url!r} is not http(s)://host:port")
        if wtype not in TYPES:
            raise ValueError(f"entry {i} ({url}): worker_type {wtype!r} is not one of {', '.join(TYPES)}")
        if not model:
            raise ValueError(f"entry {i} ({url}): model_id is missing (the served model name)")
        if url in out:
            raise ValueError(f"entry {i}: url {url} is listed twice")
        out[url] = (wtype, model)
    return out


class Router:
    """Keep-alive HTTP client of one router."""

    def __init__(self, base, timeout=10.0):
        parts = urlsplit(base)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--router {base!r}: give http://host:port")
        self.host, self.port, self.timeout = parts.hostname, parts.port or 80, timeout
        self.conn = None

    def request(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        for attempt in (1, 2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request(method, path, body=data, headers=headers)
                resp = self.conn.getresponse()
                text = resp.read().decode("utf-8", "replace")
                return resp.status, text
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def wait_live(self, seconds):
        deadline = time.monotonic() + seconds
        last = "no answer"
        while True:
            try:
                status, text = self.request("GET", "/liveness")
                if status == 200:
                    return
                last = f"HTTP {status} {text[:200]}"
            except OSError as e:
                last = str(e)
            if time.monotonic() >= deadline:
                raise RouterError(f"router {self.host}:{self.port} not live after {seconds:.0f}s: {last}")
            time.sleep(0.5)

    def registry(self):
        """{url: (type, model)} of the router, and the raw worker list."""
        status, text = self.request("GET", "/workers")
        if status != 200:
            raise RouterError(f"GET /workers: HTTP {status}: {text[:300]}")
        doc = json.loads(text)
        stats = doc.get("stats") or {}
        if "by_type" not in stats:
            raise NotIgwError(
                "the router is not in IGW mode (started without --enable-igw): vllm-router 0.1.17 cannot add a "
                "worker back at runtime in --vllm-pd-disaggregation mode; set pd_router_igw: true and redeploy "
                "the router (playbooks/deploy.yml, pd_router)")
        workers = doc.get("workers") or []
        return {w["url"]: (w["worker_type"], w.get("model_id")) for w in workers}, workers

    def put(self, url, wtype, model):
        status, text = self.request("POST", "/workers", {"url": url, "worker_type": wtype, "model_id": model})
        if status != 200:
            raise RouterError(f"POST /workers {url} ({wtype}): HTTP {status}: {text[:300]}")

    def delete(self, url):
        status, text = self.request("DELETE", "/workers/" + quote(url, safe=""))
        if status not in (200, 404):
            raise RouterError(f"DELETE /workers/{url}: HTTP {status}: {text[:300]}")


def execute(router, ops, current, models):
    """Apply ``ops`` in order; measure the time any of ``models`` had no routable set (ms)."""
    reg, broken_since, window = current, None, 0.0
    if _broken_models(reg, models):
        broken_since = time.monotonic()
    for op in ops:
        if op[0] == "put":
            router.put(op[1], op[2], op[3])
        else:
            router.delete(op[1])
        reg = _apply(reg, op)
        now = time.monotonic()
        if _broken_models(reg, models):
            broken_since = broken_since if broken_since is not None else now
        elif broken_since is not None:
            window += now - broken_since
            broken_since = None
    return round(window * 1000.0, 3)


@contextlib.contextmanager
def state_lock(path, exclusive):
    """flock on the state file's lock (``<state>.lock``): ``set`` exclusive, the watcher's re-add shared."""
    if not path:
        yield
        return
    if exclusive:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    else:
        # The watcher may run on a read-only view of the state directory: it never creates the lock. No lock
        # file yet means no `set --state` ever ran, so there is no drain to respect.
        try:
            fd = os.open(path + ".lock", os.O_RDONLY)
        except FileNotFoundError:
            yield
            return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def write_state(path, wanted):
    """The wanted list ``set`` applied, for the watcher (atomic replace)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump([{"url": u, "worker_type": t, "model_id": m} for u, (t, m) in sorted(wanted.items())], f)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def read_wanted(state, workers):
    """What the watcher may put back: the last applied wanted list, else the topology file."""
    for path in (state, workers):
        if path and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return parse_wanted(json.load(f))
    return {}


def cmd_set(args, router):
    raw = args.workers_raw if getattr(args, "workers_raw", None) is not None else (
        sys.stdin.read() if args.workers == "-" else open(args.workers, encoding="utf-8").read())
    wanted = parse_wanted(json.loads(raw), args.model)
    state = getattr(args, "state", None)
    if state and not args.dry_run and not getattr(args, "state_locked", False):
        # Write-ahead under the lock: the watcher never puts back a worker this change takes out.
        with state_lock(state, exclusive=True):
            write_state(state, wanted)
            return _set(args, router, wanted)
    return _set(args, router, wanted)


def _set(args, router, wanted):
    if args.wait:
        router.wait_live(args.wait)
    current, _workers = router.registry()
    ops, broken = plan(current, wanted)
    models = [m for m, ok in routable(wanted).items() if ok]
    unroutable = sorted({m for _kind, m in wanted.values()} - set(models))
    report = {
        "changed": bool(ops), "ops": [list(o) for o in ops], "broken_states": broken,
        "before": {u: list(v) for u, v in sorted(current.items())},
        "after": {u: list(v) for u, v in sorted(wanted.items())},
        "unroutable_models_after": unroutable, "window_ms": 0.0, "dry_run": args.dry_run,
    }
    if ops and not args.dry_run:
        report["window_ms"] = execute(router, ops, current, models)
        after, _workers = router.registry()
        if after != wanted:
            raise RouterError(f"registry after the changes differs from the wanted one: {after} != {wanted}")
    print(json.dumps(report, sort_keys=True))
    return 0


def cmd_list(args, router):
    if args.wait:
        router.wait_live(args.wait)
    _registry, workers = router.registry()
    print(json.dumps({"workers": workers, "routable": routable({w["url"]: (w["worker_type"], w.get("model_id"))
                                                                for w in workers})}, sort_keys=True))
    return 0


def cmd_many(args, urls):
    """Run the command on every router; one combined JSON report."""
    reports = {}
    if args.cmd == "set":
        # Read the wanted list once: stdin is consumed by the first read.
        args.workers_raw = sys.stdin.read() if args.workers == "-" else open(args.workers, encoding="utf-8").read()
        if args.state and not args.dry_run:
            # One write-ahead and one lock for every router.
            with state_lock(args.state, exclusive=True):
                write_state(args.state, parse_wanted(json.loads(args.workers_raw), args.model))
                args.state_locked = True
                return _many(args, urls, reports)
    return _many(args, urls, reports)


def _many(args, urls, reports):
    import io

    for url in urls:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = {"list": cmd_list, "set": cmd_set}[args.cmd](args, Router(url, args.timeout))
        if rc != 0:
            return rc
        reports[url] = json.loads(buf.getvalue())
    first = reports[urls[0]]
    out = {"routers": reports}
    if args.cmd == "set":
        out.update({"changed": any(r["changed"] for r in reports.values()),
                    "ops": [op for r in reports.values() for op in r["ops"]],
                    "window_ms": max(r["window_ms"] for r in reports.values()),
                    "broken_states": max(r["broken_states"] for r in reports.values()),
                    "before": first["before"], "after": first["after"],
                    "unroutable_models_after": first["unroutable_models_after"], "dry_run": args.dry_run})
    else:
        out.update({"workers": first["workers"], "routable": first["routable"]})
    print(json.dumps(out, sort_keys=True))
    return 0


def probe_refused(url, timeout):
    """True when nothing listens at the worker's address (connection refused or no route): the process is gone.
    A timeout or any other error is not taken as death (a busy worker)."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout):
            return False
    except OSError as e:
        return e.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)


def probe_healthy(url, timeout):
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class Watcher:
    """One pass over the routers per tick (``watch``); the state between ticks is the health streak of each worker
    that is wanted but not registered somewhere."""

    def __init__(self, routers, workers, *, state=None, successes=2, probe_timeout=0.25, out=None):
        self.routers, self.workers, self.state = routers, workers, state
        self.successes, self.probe_timeout = successes, probe_timeout
        self.streak = {}
        self.out = out or sys.stdout

    def log(self, **event):
        print(json.dumps(dict(event, t=round(time.time(), 3)), sort_keys=True), file=self.out, flush=True)

    def tick(self):
        refused, registries = {}, {}
        for router in self.routers:
            where = f"{router.host}:{router.port}"
            try:
                registry, _workers = router.registry()
            except (RouterError, OSError, http.client.HTTPException, ValueError) as e:
                self.log(event="router_unreachable", router=where, error=str(e)[:200])
                continue
            for url in sorted(registry):
                if url not in refused:
                    refused[url] = probe_refused(url, self.probe_timeout)
                if refused[url]:
                    router.delete(url)
                    del registry[url]
                    self.log(event="removed", router=where, url=url, reason="connection refused")
            registries[router] = registry
        self._put_back(registries)

    def _put_back(self, registries):
        with state_lock(self.state, exclusive=False):
            wanted = read_wanted(self.state, self.workers)
            missing = {u: v for u, v in wanted.items() if any(u not in reg for reg in registries.values())}
            self.streak = {u: n for u, n in self.streak.items() if u in missing}
            for url, (wtype, model) in sorted(missing.items()):
                healthy = probe_healthy(url, max(self.probe_timeout, 1.0))
                self.streak[url] = self.streak.get(url, 0) + 1 if healthy else 0
                if self.streak[url] < self.successes:
                    continue
                for router, reg in registries.items():
                    if url not in reg:
                        router.put(url, wtype, model)
                        self.log(event="put_back", router=f"{router.host}:{router.port}", url=url,
                                 worker_type=wtype, healthy_checks=self.streak[url])
                del self.streak[url]

    def run(self, interval, ticks=None):
        n = 0
        while ticks is None or n < ticks:
            start = time.monotonic()
            try:
                self.tick()
            except (RouterError, OSError, http.client.HTTPException, ValueError) as e:
                self.log(event="error", error=str(e)[:300])
            n += 1
            time.sleep(max(0.0, interval - (time.monotonic() - start)))
        return 0


def cmd_watch(args, urls):
    if args.successes < 1 or not args.interval > 0:
        raise ValueError("--successes must be >= 1 and --interval > 0")
    routers = [Router(u, args.timeout) for u in urls]
    # Each tick the probes of one router's registry happen with the router's own answers; a router restart
    # (empty registry) is converged back by the router unit's own `set` (ExecStartPost) and by the put-backs.
    watcher = Watcher(routers, args.workers, state=args.state, successes=args.successes,
                      probe_timeout=args.probe_timeout)
    return watcher.run(args.interval, args.ticks)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="pd-router-workers", description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("--router", action="append", help="router base URL (repeat for several routers; "
                    "default http://127.0.0.1:8000)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_list = sub.add_parser("list", help="print the registry (JSON)")
    p_list.add_argument("--wait", type=float, default=0.0, help="wait up to S seconds for /liveness first")
    p_set = sub.add_parser("set", help="make the registry equal the wanted list")
    p_set.add_argument("--workers", required=True, help="JSON file of [{url, worker_type, model_id}], - = stdin")
    p_set.add_argument("--model", help="model_id for entries without one")
    p_set.add_argument("--wait", type=float, default=0.0, help="wait up to S seconds for /liveness first")
    p_set.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p_set.add_argument("--state", help="write the applied wanted list here (under its lock) for the watcher")
    p_watch = sub.add_parser("watch", help="take dead workers out at once, put wanted ones back when healthy")
    p_watch.add_argument("--workers", required=True, help="the topology (JSON), wanted when no --state was written")
    p_watch.add_argument("--state", help="the wanted list the last `set --state` applied")
    p_watch.add_argument("--interval", type=float, default=0.25, help="seconds between passes")
    p_watch.add_argument("--probe-timeout", type=float, default=0.25, help="seconds per connect probe")
    p_watch.add_argument("--successes", type=int, default=2, help="healthy checks in a row before a put-back")
    p_watch.add_argument("--ticks", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    urls = args.router or ["http://127.0.0.1:8000"]
    try:
        if args.cmd == "watch":
            return cmd_watch(args, urls)
        if len(urls) == 1:
            return {"list": cmd_list, "set": cmd_set}[args.cmd](args, Router(urls[0], args.timeout))
        return cmd_many(args, urls)
    except NotIgwError as e:
        print(f"pd-router-workers: {e}", file=sys.stderr)
        return 3
    except (ValueError, OSError) as e:
        print(f"pd-router-workers: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    except RouterError as e:
        print(f"pd-router-workers: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
