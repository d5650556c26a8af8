"""roles/pd_router IGW mode: files/pd_router_workers.py (the registry tool) and the --enable-igw argv.

Pure tests of the change planner, then the real vllm-router 0.1.17 (.cache/router-venv) on 127.0.0.1 in front of
stub workers (HTTP servers that answer /health, /v1/models and /v1/completions like a vLLM prefill or decode
instance, and log what they get): what docs/upgrades.md reports is checked here.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "pd_router"
ROUTER_VENV = ROOT / ".cache" / "router-venv"
TOOL = ROLE / "files" / "pd_router_workers.py"

from ansible_collections.b300.pd.bench.pd_cluster import load as load_cluster  # noqa: E402
from ansible_collections.b300.pd.plugins.plugin_utils import pd_router as pdr  # noqa: E402
from ansible_collections.b300.pd.roles.pd_router.files import pd_router_workers as prw  # noqa: E402
from ansible_collections.b300.pd.tests.unit.pd_testlib import load_inventory  # noqa: E402

DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())

P0, P1, D0 = "http://p0:1", "http://p1:1", "http://d0:1"
PD = {P0: ("prefill", "m"), P1: ("prefill", "m"), D0: ("decode", "m")}
COLO = {P0: ("regular", "m"), P1: ("regular", "m")}


def test_routable_per_model():
    assert prw.routable(PD) == {"m": True}
    assert prw.routable({P0: ("prefill", "m")}) == {"m": False}
    assert prw.routable({P0: ("regular", "m"), D0: ("decode", "m")}) == {"m": False}
    assert prw.routable(COLO) == {"m": True}
    assert prw.routable({P0: ("prefill", "m"), D0: ("decode", "x")}) == {"m": False, "x": False}


def test_plan_drain_one_prefill_is_one_delete_without_a_broken_state():
    ops, broken = prw.plan(PD, {P0: PD[P0], D0: PD[D0]})
    assert ops == [("delete", P1)] and broken == 0


def test_plan_pd_to_colocated_and_back_cost_one_broken_state_each():
    ops, broken = prw.plan(PD, COLO)
    assert broken == 1 and len(ops) == 3
    assert {o[0] for o in ops[:2]} == {"put"} and ops[-1] == ("delete", D0)
    ops, broken = prw.plan(COLO, PD)
    assert broken == 1 and sorted(o[1] for o in ops) == [D0, P0, P1]
    # The order the planner picked really has one broken intermediate state and ends routable.
    reg = COLO
    states = []
    for op in ops:
        reg = prw._apply(reg, op)
        states.append(prw.routable(reg)["m"])
    assert states[-1] is True and states[:-1].count(False) == 1


def test_plan_nothing_to_do():
    assert prw.plan(PD, dict(PD)) == ([], 0)


def test_parse_wanted_rejects_bad_entries():
    assert prw.parse_wanted([{"url": P0, "worker_type": "prefill", "model_id": "m"}]) == {P0: ("prefill", "m")}
    assert prw.parse_wanted([{"url": P0, "worker_type": "regular"}], "m") == {P0: ("regular", "m")}
    for bad, msg in [([{"url": "p0:1", "worker_type": "prefill", "model_id": "m"}], "not http"),
                     ([{"url": P0, "worker_type": "both", "model_id": "m"}], "worker_type"),
                     ([{"url": P0, "worker_type": "prefill"}], "model_id is missing"),
                     ([{"url": P0, "worker_type": "prefill", "model_id": "m"}] * 2, "listed twice"),
                     ({"url": P0}, "JSON list")]:
        with pytest.raises(ValueError, match=msg):
            prw.parse_wanted(bad)


@pytest.mark.parametrize("inv", ["local", "b300"])
def test_igw_argv_is_accepted_by_the_real_router_and_registry_is_the_topology(inv):
    data = load_inventory(inv)
    workers = pdr.pd_router_workers(load_cluster(ROOT / "inventory" / inv), list(data["hosts"]))
    s = {"kv_connector": "nixl", "host": "0.0.0.0", "port": 8000, "metrics_host": "0.0.0.0",  # noqa: S104
         "metrics_port": 29000, "policy": "round_robin", "prefill_policy": "cache_aware",
         "decode_policy": "round_robin", "igw": True}
    argv = pdr.pd_router_argv(workers, s)
    assert argv[0] == "--enable-igw"
    # In IGW mode the router picks P/D workers with --policy: it carries the prefill policy.
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    code = ("import dataclasses, json, sys\nfrom vllm_router.launch_router import parse_router_args\n"
            "print(json.dumps(dataclasses.asdict(parse_router_args(json.loads(sys.argv[1]))), default=str))")
    p = subprocess.run([str(ROUTER_VENV / "bin" / "python"), "-c", code, json.dumps(argv)], capture_output=True,
                       text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    ra = json.loads(p.stdout)
    assert ra["enable_igw"] is True and ra["policy"] == "cache_aware"
    reg = pdr.pd_router_registry(workers, "served")
    assert [(r["url"], r["worker_type"]) for r in reg] == (
        [(w["url"], "prefill") for w in workers["prefill"]] + [(w["url"], "decode") for w in workers["decode"]])
    assert {r["model_id"] for r in reg} == {"served"}
    with pytest.raises(Exception, match="pd_router_model_id"):
        pdr.pd_router_registry(workers, "")
    # Off by default (its /v1/models is not OpenAI-shaped); site.yml's drain-first change path needs it, so both
    # inventories set it (and the front door answers /v1/models itself).
    assert DEFAULTS["pd_router_igw"] is False


# ---------- the real router in front of stub workers ----------

class QuietJSONHandler(BaseHTTPRequestHandler):
    """Base of the stub servers' handlers (here and in test_pd_rollout_tasks): HTTP/1.1, no request log, and
    _send(code, obj) answering JSON (or obj as is, with another content type) with its Content-Length."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, code, obj, ctype="application/json"):
        body = (json.dumps(obj) if ctype == "application/json" else obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Stub:
    """A vLLM-like worker: prefill answers kv_transfer_params to do_remote_decode requests."""

    def __init__(self, name, delay=0.0):
        self.name, self.delay, self.log = name, delay, []
        stub = self

        class H(QuietJSONHandler):

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200, {})
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
                return self._send(404, {})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                kv = req.get("kv_transfer_params")
                time.sleep(stub.delay)
                if kv and kv.get("do_remote_decode"):
                    stub.log.append("prefill")
                    out = {"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": stub.name,
                                                  "remote_block_ids": [1], "remote_host": "h", "remote_port": 1}}
                    text = "x"
                elif kv:
                    stub.log.append("decode")
                    text = f"{stub.name}:decode-after-{kv['remote_engine_id']}"
                    out = {}
                else:
                    stub.log.append("whole")
                    text, out = f"{stub.name}:whole", {}
                out.update({"id": "c", "object": "text_completion", "model": "m",
                            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                return self._send(200, out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def router(*args, command=None, env=None):
    """A real vllm-router on 127.0.0.1 with `args`, live before it is yielded (its base URL). `command`: what starts
    it instead of the vllm-router executable (e.g. the role's launcher), `env`: its environment."""
    exe = ROUTER_VENV / "bin" / "vllm-router"
    if not exe.exists():
        pytest.fail(f"{exe} missing: run scripts/bootstrap --local (stage 55-router-wheelhouse)")
    port, mport = _free_port(), _free_port()
    proc = subprocess.Popen([*(command or [str(exe)]), "--host", "127.0.0.1", "--port", str(port),
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport),
                             "--policy", "round_robin", "--health-check-interval-secs", "60", "--log-level",
                             "warning", *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base + "/liveness", timeout=2).read()  # noqa: S310 - local URL
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("vllm-router did not start")
                time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def call(method, url, body=None, headers=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,  # noqa: S310 - local URL
                                 headers={**({"Content-Type": "application/json"} if data else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - local URL
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def complete(base):
    status, text = call("POST", base + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4})
    return status, (json.loads(text)["choices"][0]["text"] if status == 200 else text)


def tool(base, *args, stdin=None):
    p = subprocess.run([sys.executable, str(TOOL), "--router", base, *args], input=stdin, capture_output=True,
                       text=True, timeout=60, check=False)
    return p.returncode, p.stdout, p.stderr


def wanted(entries):
    return json.dumps([{"url": u, "worker_type": t, "model_id": "m"} for u, t in entries])


def test_plain_pd_mode_cannot_add_a_worker_back_and_the_tool_says_so():
    p0, d0 = Stub("p0"), Stub("d0")
    with router("--vllm-pd-disaggregation", "--prefill", p0.url, "none", "--decode", d0.url) as base:
        assert complete(base) == (200, "d0:decode-after-p0")
        assert call("POST", f"{base}/remove_worker?url={d0.url}")[0] == 200
        status, text = complete(base)
        assert status == 503 and "0 decode" in text          # no fallback to colocated serving
        status, text = call("POST", f"{base}/add_worker?url={d0.url}")
        assert status == 400 and "add_prefill_server or add_decode_server" in text
        status, text = call("POST", base + "/workers", {"url": d0.url, "worker_type": "decode"})
        assert status == 400
        rc, _out, err = tool(base, "list")
        assert rc == 3 and "not in IGW mode" in err


def test_igw_drain_fallback_and_return_with_the_tool():
    p0, p1, d0 = Stub("p0"), Stub("p1"), Stub("d0", delay=1.0)
    pd = [(p0.url, "prefill"), (p1.url, "prefill"), (d0.url, "decode")]
    with router("--enable-igw") as base:
        assert complete(base)[0] == 503                       # IGW starts with an empty registry
        rc, out, err = tool(base, "set", "--workers", "-", stdin=wanted(pd))
        assert rc == 0, err
        assert json.loads(out)["changed"] is True
        texts = {complete(base)[1] for _i in range(4)}
        assert texts == {"d0:decode-after-p0", "d0:decode-after-p1"}
        # Idempotent.
        rc, out, _err = tool(base, "set", "--workers", "-", stdin=wanted(pd))
        assert rc == 0 and json.loads(out)["changed"] is False

        # Drain p1: only p0 prefills.
        rc, out, _err = tool(base, "set", "--workers", "-", stdin=wanted([pd[0], pd[2]]))
        assert rc == 0 and json.loads(out)["broken_states"] == 0
        p1.log.clear()
        assert {complete(base)[1] for _i in range(3)} == {"d0:decode-after-p0"} and p1.log == []

        # Decode out while a request is in flight on it: the request completes; whole requests go to the
        # prefill pool as regular workers.
        result = {}
        t = threading.Thread(target=lambda: result.update(r=complete(base)))
        t.start()
        time.sleep(0.3)
        colo = [(p0.url, "regular"), (p1.url, "regular")]
        rc, out, _err = tool(base, "set", "--workers", "-", stdin=wanted(colo))
        rep = json.loads(out)
        assert rc == 0 and rep["broken_states"] == 1 and rep["window_ms"] < 1000
        t.join(30)
        assert result["r"] == (200, "d0:decode-after-p0")
        d0.log.clear()
        assert {complete(base)[1] for _i in range(4)} == {"p0:whole", "p1:whole"} and d0.log == []

        # Back to P/D.
        rc, out, _err = tool(base, "set", "--workers", "-", stdin=wanted(pd))
        assert rc == 0 and json.loads(out)["broken_states"] == 1
        assert {complete(base)[1] for _i in range(4)} == {"d0:decode-after-p0", "d0:decode-after-p1"}
        rc, out, _err = tool(base, "list")
        assert rc == 0 and json.loads(out)["routable"] == {"m": True}


def test_several_routers_get_the_same_registry_from_one_stdin():
    """The front door sends requests to every P/D router: a drain changes all of them (one --router each), the wanted
    list read once from stdin."""
    p0, d0 = Stub("p0"), Stub("d0")
    pd = [(p0.url, "prefill"), (d0.url, "decode")]
    with router("--enable-igw") as a, router("--enable-igw") as b:
        p = subprocess.run([sys.executable, str(TOOL), "--router", a, "--router", b, "set", "--workers", "-"],
                           input=wanted(pd), capture_output=True, text=True, timeout=60, check=False)
        assert p.returncode == 0, p.stderr
        rep = json.loads(p.stdout)
        assert rep["changed"] is True and sorted(rep["routers"]) == sorted([a, b])
        assert all(r["changed"] for r in rep["routers"].values())
        assert complete(a) == (200, "d0:decode-after-p0") and complete(b) == (200, "d0:decode-after-p0")
        p = subprocess.run([sys.executable, str(TOOL), "--router", a, "--router", b, "list"],
                           capture_output=True, text=True, timeout=60, check=False)
        assert p.returncode == 0, p.stderr
        assert all(r["routable"] == {"m": True} for r in json.loads(p.stdout)["routers"].values())
