"""roles/pd_frontdoor: the nginx front door, rendered from the role's template and run by the real nginx.

- the filters: which routers sit behind a front door (loopback vs. reachable routers, P/D first), and the client
  keys' checks (nothing can be injected into nginx's config through a key);
- the rendered config under the distribution's nginx (`nginx -t`, then a real nginx on a free port) in front of
  small HTTP servers standing in for the routers: no key / a wrong key -> 401, the routers' admin paths -> 404,
  a request whose P/D routers fail (HTTP 500, connection refused) is served by the colocated router with the
  client's key stripped, a streaming response that broke after its first byte is not retried, and the access log
  it writes turned into metrics by the real mtail program of the role.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jinja2
import pytest
import yaml
from ansible.errors import AnsibleError
from ansible_collections.b300.pd.plugins.plugin_utils import pd_frontdoor as pdf

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "pd_frontdoor"
ERR = (ValueError, AnsibleError)  # the filters raise AnsibleFilterError under Ansible
KEY = "k" * 8 + "0123456789abcdef0123456789abcdef"
KEY2 = "Q.w+e" * 6  # regex metacharacters of the key alphabet, upper case
WORKER_KEY = "w" * 64  # pd_router_api_key: what the front door sends the routers instead of the client's key


def _units(*ports_modes):
    return [{"name": f"vllm-router-{i}", "mode": m, "port": p, "metrics_port": 29000 + i}
            for i, (p, m) in enumerate(ports_modes)]


def _cluster(*hosts):
    """The routers part of the cluster view (pd_cluster.routers) for router hosts r1, r2, ... at 10.0.0.<n>."""
    return {"routers": [{"host": h, "address": f"10.0.0.{n}", "units": _units((8001, "pd"), (8009, "colocated"))}
                        for n, h in enumerate(hosts, 1)]}


def test_backends_loopback_routers_are_only_this_hosts():
    cluster = _cluster("r1", "r2")
    local = pdf.pd_frontdoor_backends(cluster, "r1", "127.0.0.1")
    assert [b["address"] for b in local] == ["127.0.0.1:8001", "127.0.0.1:8009"]
    both = pdf.pd_frontdoor_backends(cluster, "r2", "0.0.0.0")  # noqa: S104 - compared, not bound
    # P/D routers of both hosts first (own host on loopback), then the colocated ones.
    assert [(b["address"], b["mode"]) for b in both] == [
        ("10.0.0.1:8001", "pd"), ("127.0.0.1:8001", "pd"), ("10.0.0.1:8009", "colocated"),
        ("127.0.0.1:8009", "colocated")]
    assert both[0]["name"] == "r1/vllm-router-0"


def test_backends_need_the_cluster_view_and_a_router_host():
    with pytest.raises(ERR, match=r"pd_cluster \(the cluster view\) is not defined.*playbooks/validate.yml"):
        pdf.pd_frontdoor_backends(None, "r1")
    with pytest.raises(ERR, match="not in group 'router_hosts'"):
        pdf.pd_frontdoor_backends(_cluster("r1"), "elsewhere")


@pytest.mark.parametrize("keys, match", [
    ([], "empty"), ("single-string-key-0123456789", "not a list"), (["short"], r"pd_frontdoor_api_keys\[0\]"),
    (['x' * 30 + '" 1; default 1; "'], r"\[0\] is not"), (["a" * 30 + " b"], r"\[0\] is not"),
    ([KEY, KEY], "repeats"),
])
def test_bad_keys_are_refused_without_showing_them(keys, match):
    with pytest.raises(ERR, match=match) as err:
        pdf.pd_frontdoor_keys(keys)
    for k in keys if isinstance(keys, list) else []:
        assert len(k) < 24 or k not in str(err.value)


# --- the rendered config under the real nginx ---------------------------------------------------------------------

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
MTAIL = shutil.which("mtail") or "/usr/bin/mtail"
needs_nginx = pytest.mark.skipif(not Path(NGINX).exists() or not Path(MTAIL).exists(),
                                 reason="nginx and mtail come from scripts/bootstrap.d/20-apt (run scripts/bootstrap)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Upstream:
    """A stand-in router: answers every request with a fixed behaviour and records what it received."""

    def __init__(self, name: str, behaviour: str):
        self.name, self.behaviour, self.seen = name, behaviour, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                outer.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                if outer.behaviour == "500":
                    data = b'{"error": "prefill worker failed"}'
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                elif outer.behaviour.startswith("sleep-"):
                    time.sleep(float(outer.behaviour[6:]))
                    data = json.dumps({"served_by": outer.name, "choices": [{"text": "ok"}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                elif outer.behaviour == "500-then-200" and len(outer.seen) % 2 == 1:
                    data = b'{"error": "Request failed: error sending request for url (http://prefill-0)"}'
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                elif outer.behaviour == "429":
                    data = b'{"error": "router busy"}'
                    self.send_response(429)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                elif outer.behaviour == "stream-then-die":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b'data: {"choices": [{"text": "first"}]}\n\n')
                    self.wfile.flush()
                    self.close_connection = True
                else:
                    data = json.dumps({"served_by": outer.name, "choices": [{"text": "ok"}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _context(tmp: Path, port: int, backends: list[dict], **extra) -> dict:
    """The role's template variables: its plain defaults, then this test's paths, port and routers."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    admission = extra.pop("admission", {})
    return {**{k: v for k, v in defaults.items() if not isinstance(v, str) or "{{" not in v},
            "ansible_managed": "test", "pd_frontdoor_port": port, "pd_frontdoor_bind_host": "127.0.0.1",
            "pd_frontdoor_listen_ipv6": False, "pd_frontdoor_request_timeout_s": 30,
            "pd_frontdoor_config_dir": str(tmp), "pd_frontdoor_access_log": str(tmp / "access.log"),
            "_pd_frontdoor_backends": backends, "pd_frontdoor_api_keys": [KEY, KEY2], "pd_frontdoor_model": "tiny-pd",
            "_pd_frontdoor_admission": pdf.pd_frontdoor_admission(
                admission.get("max_inflight", 0), admission.get("max_rate", 0), admission.get("share", 0.5),
                admission.get("reserve", 0.5), admission.get("body", ""), admission.get("max_model_len", 4096)),
            "pd_frontdoor_gate_port": _free_port(), "_pd_frontdoor_tls": {},
            **extra}


def _render(tmp: Path, port: int, backends: list[dict], **extra) -> None:
    # nginx config, not HTML: nothing to escape (Ansible renders it the same way).
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(ROLE / "templates")), keep_trailing_newline=True,  # noqa: S701
                             undefined=jinja2.StrictUndefined)
    env.filters["bool"] = lambda v: str(v).lower() in ("1", "true", "yes")
    env.filters["b300.pd.pd_frontdoor_key_map"] = pdf.pd_frontdoor_key_map
    ctx = _context(tmp, port, backends, **extra)
    (tmp / "pd-frontdoor.conf").write_text(env.get_template("pd-frontdoor.conf.j2").render(**ctx))
    (tmp / "api-keys.map").write_text(env.get_template("api-keys.map.j2").render(**ctx))
    # The workers' key header, as the role's task writes it (its content rendered with the same context).
    task = next(t for t in yaml.safe_load((ROLE / "tasks" / "main.yml").read_text())
                if t.get("name") == "Write the workers' key header (root-only, read by nginx's master process)")
    (tmp / "worker-auth.conf").write_text(env.from_string(task["ansible.builtin.copy"]["content"]).render(
        **{"pd_frontdoor_worker_api_key": WORKER_KEY, **ctx}))
    for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (tmp / d).mkdir()
    (tmp / "nginx.conf").write_text(f"""
daemon on;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log;
events {{ worker_connections 64; }}
http {{
    client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
    include {tmp}/pd-frontdoor.conf;
}}
""")


@contextlib.contextmanager
def _nginx(tmp: Path, port: int):
    """The real nginx on the config _render wrote into `tmp`, listening on `port` until the block ends."""
    subprocess.run([NGINX, "-p", str(tmp), "-c", str(tmp / "nginx.conf")], check=True)
    try:
        for _attempt in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield
    finally:
        subprocess.run([NGINX, "-p", str(tmp), "-c", str(tmp / "nginx.conf"), "-s", "stop"], check=False)


@contextlib.contextmanager
def _one_router(tmp_path, behaviour, **render):
    """The role's config rendered into tmp_path in front of one stand-in P/D router, run by the real nginx:
    -> (nginx's port, the router); both stopped when the block ends."""
    up = _Upstream("pd", behaviour)
    port = _free_port()
    try:
        _render(tmp_path, port, [{"name": "r/vllm-router", "address": f"127.0.0.1:{up.port}", "mode": "pd"}],
                **render)
        with _nginx(tmp_path, port):
            yield port, up
    finally:
        up.close()


@pytest.fixture
def frontdoor(tmp_path):
    """A real nginx with the role's config in front of: P/D router A (HTTP 500), P/D router B (connection refused),
    the colocated router (200)."""
    ups = {"pd_a": _Upstream("pd_a", "500"), "colocated": _Upstream("colocated", "200")}
    refused = _free_port()
    backends = [{"name": "r/vllm-router", "address": f"127.0.0.1:{ups['pd_a'].port}", "mode": "pd"},
                {"name": "r/vllm-router-2", "address": f"127.0.0.1:{refused}", "mode": "pd"},
                {"name": "r/vllm-router-colocated", "address": f"127.0.0.1:{ups['colocated'].port}",
                 "mode": "colocated"}]
    port = _free_port()
    _render(tmp_path, port, backends)
    check = subprocess.run([NGINX, "-t", "-q", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                           capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr
    try:
        with _nginx(tmp_path, port):
            yield {"url": f"http://127.0.0.1:{port}", "ups": ups, "dir": tmp_path}
    finally:
        for u in ups.values():
            u.close()


def _req(url, method="POST", key=None, body=b'{"prompt": "hi"}', headers=None):
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body if method == "POST" else None, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@needs_nginx
def test_clients_need_the_key_and_admin_paths_are_closed(frontdoor):
    url = frontdoor["url"]
    assert _req(url + "/v1/completions")[0] == 401
    assert _req(url + "/v1/completions", key="x" * 40)[0] == 401
    assert _req(url + "/v1/completions", headers={"Authorization": KEY})[0] == 401
    for method, path in (("GET", "/workers"), ("POST", "/workers"), ("POST", "/remove_worker?url=http://x:1"),
                         ("POST", "/add_worker?url=http://x:1"), ("GET", "/list_workers"), ("POST", "/flush_cache"),
                         ("DELETE", "/workers/x"), ("GET", "/metrics"), ("GET", "/scheduling/diagnostics"),
                         ("POST", "/finish_session"), ("GET", "/get_loads"), ("GET", "/health/x")):
        assert _req(url + path, method=method, key=KEY)[0] == 404, (method, path)
    # The model list is the front door's own, OpenAI-shaped whatever the routers' mode (IGW answers {"models": ...}),
    # and needs the key like every /v1/ path.
    assert _req(url + "/v1/models", method="GET")[0] == 401
    status, body = _req(url + "/v1/models", method="GET", key=KEY)
    assert status == 200 and json.loads(body) == {"object": "list", "data": [
        {"id": "tiny-pd", "object": "model", "owned_by": "b300-pd"}]}, body
    # Nothing of the above reached a router.
    assert all(not u.seen for u in frontdoor["ups"].values())


@needs_nginx
def test_failed_pd_routers_are_retried_on_the_colocated_router_without_the_key(frontdoor):
    status, body = _req(frontdoor["url"] + "/v1/completions", key=KEY)
    assert status == 200 and json.loads(body)["served_by"] == "colocated"
    assert len(frontdoor["ups"]["pd_a"].seen) == 2  # tried on both passes, answered 500 each time
    seen = frontdoor["ups"]["colocated"].seen
    assert len(seen) == 1 and seen[0]["body"] == b'{"prompt": "hi"}'  # the whole body, resent
    # The client's key stops at the door; the workers' key goes on (the colocated router forwards it).
    assert all(s["auth"] == f"Bearer {WORKER_KEY}" for u in frontdoor["ups"].values() for s in u.seen)
    # The failure is the worker's, not the router's (issue #31): no router rests, the next request tries the P/D
    # router again (its own health checks drop a dead worker), and the front door never runs out of upstreams.
    for n in range(2, 6):
        status, body = _req(frontdoor["url"] + "/v1/completions", key=KEY)
        assert status == 200 and json.loads(body)["served_by"] == "colocated"
        assert len(frontdoor["ups"]["pd_a"].seen) == 2 * n


@needs_nginx
def test_access_log_becomes_metrics_through_the_roles_mtail_program(frontdoor, tmp_path_factory):
    _req(frontdoor["url"] + "/v1/completions", key=KEY)
    _req(frontdoor["url"] + "/v1/completions")
    log = frontdoor["dir"] / "access.log"
    for _attempt in range(50):
        if log.exists() and len(log.read_text().splitlines()) >= 2:
            break
        time.sleep(0.1)
    progs = tmp_path_factory.mktemp("mtail")
    shutil.copy(ROLE / "files" / "pd_frontdoor.mtail", progs)
    out = subprocess.run([MTAIL, "-progs", str(progs), "-logs", str(log), "-one_shot", "-one_shot_format",
                          "prometheus", "-logtostderr"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert KEY not in log.read_text()
    assert ('pd_frontdoor_requests_total{backend="r/vllm-router-colocated",client="' + pdf.key_label(KEY) + '",'
            'path="colocated",prog="pd_frontdoor.mtail",status="200"} 1') in out, out
    assert ('pd_frontdoor_requests_total{backend="none",client="-",path="none",prog="pd_frontdoor.mtail",'
            'status="401"} 1') in out
    assert ('pd_frontdoor_retried_requests_total{first_backend="r/vllm-router",first_status="500",'
            'prog="pd_frontdoor.mtail"} 1') in out, out


@needs_nginx
def test_a_stream_that_broke_after_its_first_byte_is_not_retried(tmp_path):
    ups = {"pd": _Upstream("pd", "stream-then-die"), "colocated": _Upstream("colocated", "200")}
    backends = [{"name": "r/vllm-router", "address": f"127.0.0.1:{ups['pd'].port}", "mode": "pd"},
                {"name": "r/vllm-router-colocated", "address": f"127.0.0.1:{ups['colocated'].port}",
                 "mode": "colocated"}]
    port = _free_port()
    _render(tmp_path, port, backends)
    try:
        with _nginx(tmp_path, port):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=b'{"stream": true}',
                                         headers={"Authorization": f"Bearer {KEY}"}, method="POST")
            with urllib.request.urlopen(req, timeout=20) as r:
                assert r.status == 200
                first = r.fp.readline()
                assert first.startswith(b"data: ")
                with pytest.raises((urllib.error.URLError, ConnectionError, http_incomplete())):
                    r.read()
            assert len(ups["pd"].seen) == 1 and not ups["colocated"].seen
    finally:
        for u in ups.values():
            u.close()


def http_incomplete():
    import http.client

    return http.client.IncompleteRead


@needs_nginx
def test_tls_when_a_certificate_is_given(tmp_path):
    """pd_frontdoor_tls_certificate/_key: HTTPS on the client port, the same key check behind it."""
    cert, key = tmp_path / "fd.crt", tmp_path / "fd.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    up = _Upstream("pd", "200")
    port = _free_port()
    _render(tmp_path, port, [{"name": "r/vllm-router", "address": f"127.0.0.1:{up.port}", "mode": "pd"}],
            _pd_frontdoor_tls={"certificate": str(cert), "key": str(key), "bundle": False})
    assert f"listen 127.0.0.1:{port} ssl;" in (tmp_path / "pd-frontdoor.conf").read_text()
    import ssl

    ctx = ssl.create_default_context(cafile=str(cert))
    try:
        with _nginx(tmp_path, port):
            url = f"https://127.0.0.1:{port}/v1/completions"
            req = urllib.request.Request(url, data=b"{}", headers={"Authorization": f"Bearer {KEY}"}, method="POST")
            with urllib.request.urlopen(req, timeout=20, context=ctx) as r:
                assert r.status == 200 and json.loads(r.read())["served_by"] == "pd"
            req = urllib.request.Request(url, data=b"{}", method="POST")
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=20, context=ctx)
            assert err.value.code == 401
    finally:
        up.close()


@needs_nginx
def test_connection_limit_tasks_edit_debians_nginx_conf_and_nginx_accepts_it(tmp_path):
    # 2026-12-06 on the local stack: Debian's `worker_connections 768` made nginx answer 500 to 240 of 1245 requests
    # ("worker_connections are not enough") once ~380 were in flight. The role's two lineinfile tasks, as written in
    # tasks/nginx_config.yml (on the staged nginx.conf), run by ansible-playbook against a copy of this machine's
    # Debian nginx.conf.
    tasks = yaml.safe_load((ROLE / "tasks" / "nginx_config.yml").read_text())
    edits = [t for t in tasks if t.get("ansible.builtin.lineinfile", {}).get("path")
             == "{{ pd_frontdoor_config_dir }}/staged/nginx.conf"]
    assert len(edits) == 2
    conf = tmp_path / "nginx.conf"
    conf.write_text(Path("/etc/nginx/nginx.conf").read_text())
    for t in edits:
        t["ansible.builtin.lineinfile"]["path"] = str(conf)
        t.pop("notify", None)
    play = [{"name": "Connection limit", "hosts": "localhost", "gather_facts": False,
             "vars": {"pd_frontdoor_worker_connections": 4096}, "tasks": edits}]
    (tmp_path / "pb.yml").write_text(yaml.safe_dump(play))
    env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": str(ROOT / ".venv" / "bin") + ":/usr/bin:/bin",
           "ANSIBLE_CACHE_PLUGIN": "memory"}

    def apply():
        p = subprocess.run([str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                            str(tmp_path / "pb.yml")], capture_output=True, text=True, env=env, cwd=ROOT, check=False)
        assert p.returncode == 0, p.stdout[-3000:]
        return p.stdout

    assert "changed=2" in apply()
    text = conf.read_text()
    assert "\tworker_connections 4096;" in text and "worker_connections 768" not in text
    assert text.index("worker_rlimit_nofile 8192;") < text.index("events {")
    assert "changed=0" in apply()  # idempotent
    check = subprocess.run([NGINX, "-t", "-q", "-c", str(conf)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr


# --- admission, retries that never amplify, slow and hostile clients (issue #31) -----------------------------------

def test_admission_limits_are_derived_and_checked():
    assert pdf.pd_frontdoor_admission(20, 16, 0.5, 0.25, "", 4096) == {
        "max_inflight": 20, "reserve": 5, "max_inflight_under_share": 25, "key_rate": "8r/s", "key_burst": 8,
        "client_max_body_size": "1152k"}
    slow = pdf.pd_frontdoor_admission("7", 0.9, 0.5, 0.5, "16m")
    assert (slow["key_rate"], slow["key_burst"], slow["reserve"]) == ("27r/m", 1, 4)  # under 1 r/s: per minute
    assert pdf.pd_frontdoor_admission(0, 0, 0.5, 0.5, "", 262144) == {
        "max_inflight": 0, "reserve": 0, "max_inflight_under_share": 0, "key_rate": "", "key_burst": 0,
        "client_max_body_size": "9216k"}
    for args, match in (((-1, 1), "pd_frontdoor_max_inflight"), (("lots", 1), "pd_frontdoor_max_inflight"),
                        ((True, 1), "pd_frontdoor_max_inflight"), ((10, 0), "pd_frontdoor_max_rate"),
                        ((10, "fast"), "pd_frontdoor_max_rate"), ((10, 5, 0), "pd_frontdoor_key_share"),
                        ((10, 5, 1.5), "pd_frontdoor_key_share"), ((10, 5, "half"), "pd_frontdoor_key_share"),
                        ((10, 5, 0.5, -0.1), "pd_frontdoor_reserve_share"),
                        ((10, 5, 0.5, 0.5, "64 m; return 200"), "pd_frontdoor_client_max_body_size"),
                        ((10, 5, 0.5, 0.5, "", "4k"), "pd_frontdoor_max_model_len")):
        with pytest.raises(ERR, match=match):
            pdf.pd_frontdoor_admission(*args)


def test_key_map_is_case_sensitive_regex_with_labels():
    entries = pdf.pd_frontdoor_key_map([KEY, KEY2])
    assert entries[1]["pattern"] == "~^Bearer " + KEY2.replace(".", "\\.").replace("+", "\\+") + "$"
    assert [e["label"] for e in entries] == [pdf.key_label(KEY), pdf.key_label(KEY2)]
    assert all(len(e["label"]) == 9 and e["label"].startswith("k") for e in entries)


def _log_lines(path, n, timeout=10.0):
    """The access log's lines once it has at least n: nginx writes a line when it finalizes the request, which can
    be a moment after the client has read the whole response."""
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def _concurrently(url, keys, body=b'{"prompt": "hi"}'):
    """One request per key at once; -> [(status, seconds, headers)] in the order given."""
    out = [None] * len(keys)

    def one(i, key):
        t0 = time.monotonic()
        req = urllib.request.Request(url, data=body, headers={"Authorization": f"Bearer {key}"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                r.read()
                out[i] = (r.status, time.monotonic() - t0, dict(r.headers), b"")
        except urllib.error.HTTPError as e:
            out[i] = (e.code, time.monotonic() - t0, dict(e.headers), e.read())

    threads = [threading.Thread(target=one, args=(i, k)) for i, k in enumerate(keys)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # in this order
    for t in threads:
        t.join()
    return out


@needs_nginx
def test_admission_sheds_at_once_fills_the_cluster_with_one_key_and_keeps_room_for_another(tmp_path):
    # M = 4 in flight, a reserve of 2 for keys under their share (M + R = 6); a key's share: 1 request a second of
    # the cluster's 2 (nginx limit_req, a burst of 1: two requests at once).
    admission = {"max_inflight": 4, "max_rate": 2, "share": 0.5, "reserve": 0.5}
    with _one_router(tmp_path, "sleep-1.5", admission=admission, pd_frontdoor_retry_after_s=3) as (port, up):
        url = f"http://127.0.0.1:{port}/v1/completions"
        # KEY alone sends 6 at once: 2 under its share, 2 more over it while fewer than M are in flight (one key
        # fills the cluster), 2 refused at once. KEY2, under its share, then finds the reserve: 2 admitted (6 in
        # flight), its third is over its share with M already in flight: refused.
        res = _concurrently(url, [KEY] * 6 + [KEY2] * 3)
        statuses = [r[0] for r in res]
        assert statuses == [200, 200, 200, 200, 429, 429, 200, 200, 429], statuses
        for status, seconds, headers, body in res:
            if status == 429:
                assert seconds < 0.5, seconds  # at once, not after a queue
                assert headers.get("Retry-After") == "3"
                err = json.loads(body)["error"]
                assert err["code"] == 429 and err["type"] == "rate_limit_exceeded" and "retry after 3 s" in \
                    err["message"]
        assert len(up.seen) == 6  # nothing refused reached a router
        # nor the client's key, through the gate either: the routers get the workers' key
        assert all(s["auth"] == f"Bearer {WORKER_KEY}" for s in up.seen)
        # When the admitted ones are done, the door admits again.
        assert _req(url, key=KEY)[0] == 200
        log = _log_lines(tmp_path / "access.log", 10)
        time.sleep(0.5)  # and no eleventh line follows
        log = _log_lines(tmp_path / "access.log", 10)
        assert len(log) == 10  # every request once, whichever server took it
        assert sum("status=429 client=" + pdf.key_label(KEY) in ln for ln in log) == 2
        assert sum("status=429 client=" + pdf.key_label(KEY2) in ln for ln in log) == 1
        assert sum("status=200 client=" + pdf.key_label(KEY) + " path=pd backend=r/vllm-router" in ln
                   for ln in log) == 5
        assert not any(KEY in ln or KEY2 in ln for ln in log)
        # The gate checks the key too: a client on the router host cannot use it to skip the door.
        gate = (tmp_path / "pd-frontdoor.conf").read_text().split("listen 127.0.0.1:")[1].split(";")[0]
        assert _req(f"http://127.0.0.1:{gate}/v1/completions")[0] == 401


@needs_nginx
def test_a_key_within_its_share_cannot_take_the_reserve_from_another(tmp_path):
    # A flooding key's first share of the rate passes limit_req: without a bound its within-share requests could
    # take the reserve meant for the other keys. No key holds more than M in flight.
    # M = 4, M + R = 6; a key's share is 4 requests a second (a burst of 4: five at once).
    admission = {"max_inflight": 4, "max_rate": 4, "share": 1.0, "reserve": 0.5}
    with _one_router(tmp_path, "sleep-1.5", admission=admission) as (port, _up):
        url = f"http://127.0.0.1:{port}/v1/completions"
        # KEY: five within its share, but only M = 4 admitted; the sixth is over its share and M are in flight.
        # KEY2 then finds the whole reserve: 6 in flight.
        statuses = [r[0] for r in _concurrently(url, [KEY] * 6 + [KEY2] * 2)]
        assert statuses == [200, 200, 200, 200, 429, 429, 200, 200], statuses


@needs_nginx
def test_no_admission_limit_when_zero(tmp_path):
    with _one_router(tmp_path, "sleep-0.5") as (port, up):
        assert "pd_frontdoor_inflight" not in (tmp_path / "pd-frontdoor.conf").read_text()
        res = _concurrently(f"http://127.0.0.1:{port}/v1/completions", [KEY] * 6)
        assert [r[0] for r in res] == [200] * 6


@needs_nginx
def test_keys_are_case_sensitive_and_a_refused_client_keeps_no_connection(tmp_path):
    with _one_router(tmp_path, "200") as (port, up):
        url = f"http://127.0.0.1:{port}/v1/completions"
        assert _req(url, key=KEY2)[0] == 200
        assert _req(url, key=KEY2.lower())[0] == 401 and _req(url, key=KEY.upper())[0] == 401
        assert _req(url, key=KEY2.replace(".", "x"))[0] == 401  # "." is no wildcard
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("POST", "/v1/completions", body=b"{}", headers={"Authorization": "Bearer nope-nope"})
        resp = conn.getresponse()
        assert resp.status == 401 and resp.getheader("Connection") == "close"
        resp.read()
        conn.close()
        assert len(up.seen) == 1


@needs_nginx
def test_a_timed_out_or_refused_for_overload_request_is_never_resent(tmp_path):
    ups = {"slow": _Upstream("slow", "sleep-3"), "busy": _Upstream("busy", "429"),
           "colocated": _Upstream("colocated", "200")}
    port = _free_port()
    backends = [{"name": "r/slow", "address": f"127.0.0.1:{ups['slow'].port}", "mode": "pd"},
                {"name": "r/colocated", "address": f"127.0.0.1:{ups['colocated'].port}", "mode": "colocated"}]
    _render(tmp_path, port, backends, pd_frontdoor_request_timeout_s=1)
    try:
        with _nginx(tmp_path, port):
            status, _body = _req(f"http://127.0.0.1:{port}/v1/completions", key=KEY)
            assert status == 504 and len(ups["slow"].seen) == 1 and not ups["colocated"].seen
    finally:
        pass
    port = _free_port()
    (tmp_path / "busy").mkdir()
    backends[0] = {"name": "r/busy", "address": f"127.0.0.1:{ups['busy'].port}", "mode": "pd"}
    _render(tmp_path / "busy", port, backends)
    try:
        with _nginx(tmp_path / "busy", port):
            status, _body = _req(f"http://127.0.0.1:{port}/v1/completions", key=KEY)
            assert status == 429 and len(ups["busy"].seen) == 1 and not ups["colocated"].seen
    finally:
        for u in ups.values():
            u.close()


@needs_nginx
def test_slow_and_oversized_clients_are_cut(tmp_path):
    with _one_router(tmp_path, "200", pd_frontdoor_client_header_timeout_s=1,
                     admission={"max_model_len": 4096}) as (port, up):
        assert "client_max_body_size 1152k;" in (tmp_path / "pd-frontdoor.conf").read_text()
        # A body over the limit derived from max-model-len (4096 x 32 B + 1 MiB) is refused before it is read.
        status, _body = _req(f"http://127.0.0.1:{port}/v1/completions", key=KEY, body=b"x" * (1152 * 1024 + 1))
        assert status == 413
        # A client that never finishes its headers is disconnected after client_header_timeout.
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        s.settimeout(10)
        assert s.recv(1024) == b""  # closed by nginx, no answer
        assert 0.5 < time.monotonic() - t0 < 5
        s.close()
        assert not up.seen


@needs_nginx
def test_a_second_pass_over_the_routers_finds_a_live_prefill(tmp_path):
    # The second after a prefill dies: each router's next pick of a prefill may be the dead one (500), the pick after
    # it a live one. Both P/D routers and the colocated one answer 500 on their first request: the second pass over
    # the P/D routers serves it, P/D, before the colocated router is asked at all.
    ups = {n: _Upstream(n, "500-then-200") for n in ("pd_a", "pd_b", "colocated")}
    backends = [{"name": "r/vllm-router", "address": f"127.0.0.1:{ups['pd_a'].port}", "mode": "pd"},
                {"name": "r/vllm-router-2", "address": f"127.0.0.1:{ups['pd_b'].port}", "mode": "pd"},
                {"name": "r/vllm-router-colocated", "address": f"127.0.0.1:{ups['colocated'].port}",
                 "mode": "colocated"}]
    port = _free_port()
    _render(tmp_path, port, backends)
    conf = (tmp_path / "pd-frontdoor.conf").read_text()
    assert conf.count(f"server 127.0.0.1:{ups['pd_a'].port} max_fails=0") == 2
    try:
        with _nginx(tmp_path, port):
            status, body = _req(f"http://127.0.0.1:{port}/v1/completions", key=KEY)
            assert status == 200 and json.loads(body)["served_by"] in ("pd_a", "pd_b")
            assert len(ups["pd_a"].seen) + len(ups["pd_b"].seen) == 3 and not ups["colocated"].seen
            log = "\n".join(_log_lines(tmp_path / "access.log", 1))
            assert "status=200" in log and "path=pd " in log and "attempts=3" in log
    finally:
        for u in ups.values():
            u.close()


# --- nginx's config staged, checked and swapped (issue #32) --------------------------------------------------------

def _strip_notify(tasks: list) -> list:
    """The role's tasks without their handler notifications (no systemd here), template sources made absolute."""
    for t in tasks:
        t.pop("notify", None)
        if "ansible.builtin.template" in t:
            t["ansible.builtin.template"]["src"] = str(ROLE / "templates" / t["ansible.builtin.template"]["src"])
        for part in ("block", "rescue", "always"):
            _strip_notify(t.get(part) or [])
    return tasks


def _run_staging(tmp: Path, variables: dict, path: str = "", reloaded: bool = True) -> subprocess.CompletedProcess:
    """tasks/nginx_config.yml, as the role has it, run by ansible-playbook with `variables` (extra vars); then, with
    `reloaded`, the role's handler that clears the pending-reload marker (no systemd here to reload nginx)."""
    tasks = yaml.safe_load((ROLE / "tasks" / "nginx_config.yml").read_text())
    if reloaded:
        handler = next(h for h in yaml.safe_load((ROLE / "handlers" / "main.yml").read_text())
                       if h["name"] == "Clear the pending nginx reload")
        tasks.append({k: v for k, v in handler.items() if k != "listen"})
    return _run_tasks(tmp, tasks, variables, path=path)


@needs_nginx
def test_a_bad_nginx_config_is_never_swapped_in_and_the_previous_one_is_kept(tmp_path):
    up = _Upstream("pd", "200")
    port = _free_port()
    fd, live = tmp_path / "fd", tmp_path / "nginx"
    for d in (fd, live / "conf.d", *(tmp_path / t for t in ("body", "proxy", "fastcgi", "uwsgi", "scgi"))):
        d.mkdir(parents=True)
    variables = _context(fd, port, [{"name": "r/vllm-router", "address": f"127.0.0.1:{up.port}", "mode": "pd"}],
                         pd_frontdoor_nginx_dir=str(live), pd_frontdoor_worker_connections=512)
    variables.pop("ansible_managed")
    (fd / "api-keys.map").write_text("".join(f'"{e["pattern"]}" {e["label"]};\n'
                                             for e in pdf.pd_frontdoor_key_map([KEY, KEY2])))
    (fd / "worker-auth.conf").write_text(f'proxy_set_header Authorization "Bearer {WORKER_KEY}";\n')
    # A Debian-shaped nginx.conf: the server block goes into conf.d through its glob include.
    (live / "nginx.conf").write_text(f"""daemon on;
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/error.log;
events {{
\tworker_connections 64;
}}
http {{
\tclient_body_temp_path {tmp_path}/body; proxy_temp_path {tmp_path}/proxy; fastcgi_temp_path {tmp_path}/fastcgi;
\tuwsgi_temp_path {tmp_path}/uwsgi; scgi_temp_path {tmp_path}/scgi;
\tinclude {live}/conf.d/*.conf;
}}
""")
    server_block = live / "conf.d" / "pd-frontdoor.conf"
    main = live / "nginx.conf"

    def run(path="", reloaded=True, **changes):
        p = _run_staging(tmp_path, {**variables, **changes}, path, reloaded=reloaded)
        return p.returncode, p.stdout

    try:
        # A swap whose reload never ran (the run failed after it, handlers lost): the marker stays, and the next
        # run, with nothing left to swap, still reloads nginx for it (seen live: nginx served Debian's default
        # config after a failed first run).
        rc, out = run(reloaded=False)
        assert rc == 0 and (fd / "reload-pending").exists(), out[-3000:]
        rc, out = run(reloaded=False)
        assert rc == 0 and "an earlier run swapped the config without reloading nginx" in out, out[-3000:]
        rc, out = run()
        assert rc == 0 and not (fd / "reload-pending").exists(), out[-3000:]
        first = server_block.read_text()
        assert f"server 127.0.0.1:{up.port}" in first and "\tworker_connections 512;" in main.read_text()
        assert not (fd / "previous" / "pd-frontdoor.conf").exists()  # a first install has nothing to keep
        rc, out = run()
        assert rc == 0 and "changed=0" in out, out[-3000:]  # idempotent: nothing staged, nothing swapped
        # A good change: swapped in, the live file of before kept as the previous one.
        rc, out = run(pd_frontdoor_tries=3)
        assert rc == 0, out[-3000:]
        second = server_block.read_text()
        assert "proxy_next_upstream_tries 3;" in second
        assert (fd / "previous" / "pd-frontdoor.conf").read_text() == first
        main_before = main.read_text()
        subprocess.run([NGINX, "-c", str(main)], check=True)
        try:
            # A render nginx refuses: the run fails naming nginx -t, and the live files stay as they were.
            rc, out = run(pd_frontdoor_body_buffer_size="1x", pd_frontdoor_worker_connections=1024)
            assert rc != 0 and "nginx -t refused the staged config" in out and "The live config is unchanged" in out, \
                out[-3000:]
            assert "client_body_buffer_size 1x;" in (fd / "staged" / "pd-frontdoor.conf").read_text()
            assert server_block.read_text() == second and main.read_text() == main_before
            assert (fd / "previous" / "pd-frontdoor.conf").read_text() == first
            # The next start or reload reads the good config: the running nginx reloads and serves.
            subprocess.run([NGINX, "-c", str(main), "-s", "reload"], check=True)
            time.sleep(0.5)
            status, body = _req(f"http://127.0.0.1:{port}/v1/completions", key=KEY)
            assert status == 200 and json.loads(body)["served_by"] == "pd"
        finally:
            subprocess.run([NGINX, "-c", str(main), "-s", "stop"], check=False)
        # The previous config can be put back and nginx accepts it.
        server_block.write_text((fd / "previous" / "pd-frontdoor.conf").read_text())
        check = subprocess.run([NGINX, "-t", "-q", "-c", str(main)], capture_output=True, text=True, check=False)
        assert check.returncode == 0, check.stderr
        # Fixed inventory: the next run stages, checks and swaps it.
        rc, out = run()
        assert rc == 0, out[-3000:]
        assert server_block.read_text() == first and (fd / "previous" / "pd-frontdoor.conf").read_text() == first
        # The swapped config fails the whole-config check (here an nginx that refuses the live nginx.conf): the
        # previous files are put back and the run fails saying so.
        wrapper = tmp_path / "bin" / "nginx"
        wrapper.parent.mkdir()
        wrapper.write_text(f'#!/bin/sh\n[ "$4" = "{main}" ] && {{ echo "simulated: live config refused" >&2; exit 1; }}'
                           f'\nexec {NGINX} "$@"\n')
        wrapper.chmod(0o755)
        rc, out = run(path=f"{wrapper.parent}:", pd_frontdoor_tries=4)
        assert rc != 0 and "the previous one is back in place" in out and "simulated" in out, out[-3000:]
        assert server_block.read_text() == first and main.read_text() == main_before
        assert "proxy_next_upstream_tries 4;" in (fd / "staged" / "pd-frontdoor.conf").read_text()
        # A first install whose swapped file fails: the file goes (no previous one), nginx keeps its own config.
        server_block.unlink()
        rc, out = run(path=f"{wrapper.parent}:")
        assert rc != 0 and "the previous one is back in place" in out, out[-3000:]
        assert not server_block.exists()
    finally:
        up.close()


# --- TLS by default: the bundle's CA, the refusal of plain HTTP (issue #32) ----------------------------------------

def _run_tasks(tmp: Path, tasks: list, variables: dict, name: str = "pb",
               path: str = "") -> subprocess.CompletedProcess:
    """Tasks of the role (handlers' notifications dropped, template sources absolute) run by ansible-playbook on
    localhost with `variables` as extra vars (`path`: directories searched first for commands)."""
    play = [{"name": name, "hosts": "localhost", "gather_facts": False, "tasks": _strip_notify(tasks)}]
    (tmp / f"{name}.yml").write_text(yaml.safe_dump(play))
    (tmp / f"{name}.json").write_text(json.dumps(variables))
    env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_CACHE_PLUGIN": "memory",
           "PATH": path + str(ROOT / ".venv" / "bin") + ":/usr/sbin:/usr/bin:/bin"}
    return subprocess.run([str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", f"@{tmp / (name + '.json')}", str(tmp / f"{name}.yml")],
                          capture_output=True, text=True, env=env, cwd=ROOT, check=False, timeout=300)


@needs_nginx
def test_tls_by_default_with_the_bundles_ca(tmp_path):
    """No certificate given: tasks/tls.yml makes a CA on the control node and a certificate for the host (SAN: its
    address and name); the rendered front door answers HTTPS that a client trusting only that CA verifies."""
    ca_dir = tmp_path / "control" / ".cache" / "tls"
    fd = tmp_path / "fd"
    fd.mkdir()
    tasks = yaml.safe_load((ROLE / "tasks" / "tls.yml").read_text())
    variables = {"_pd_frontdoor_tls_ca_dir": str(ca_dir), "ansible_host": "127.0.0.1",
                 "pd_frontdoor_config_dir": str(fd),
                 "pd_frontdoor_tls_days": 30, "pd_frontdoor_tls_renew_days": 7, "pd_frontdoor_tls_ca_days": 60,
                 "_pd_frontdoor_tls": {"certificate": str(fd / "tls" / "server.crt"),
                                       "key": str(fd / "tls" / "server.key"), "bundle": True}}
    p = _run_tasks(tmp_path, tasks, variables)
    assert p.returncode == 0, p.stdout[-3000:]
    for path, mode in ((ca_dir, 0o700), (ca_dir / "ca.key", 0o600), (ca_dir / "hosts" / "localhost.key", 0o600),
                       (fd / "tls", 0o700), (fd / "tls" / "server.key", 0o600)):
        assert path.stat().st_mode & 0o777 == mode, path
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", str(fd / "tls" / "server.crt")],
                          capture_output=True, text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in text and "DNS:localhost" in text and "CA:FALSE" in text
    assert "BEGIN" not in p.stdout  # no key or certificate in the play's output
    # A second run makes nothing again (the certificate is valid for longer than the renewal margin).
    p = _run_tasks(tmp_path, tasks, variables)
    assert p.returncode == 0 and "changed=0" in p.stdout, p.stdout[-3000:]
    # Near its end (renewal margin above its validity): made again, still signed by the same CA.
    before = (fd / "tls" / "server.crt").read_text()
    p = _run_tasks(tmp_path, tasks, {**variables, "pd_frontdoor_tls_renew_days": 45})
    assert p.returncode == 0, p.stdout[-3000:]
    assert (fd / "tls" / "server.crt").read_text() != before

    import ssl

    up = _Upstream("pd", "200")
    port = _free_port()
    try:
        _render(fd, port, [{"name": "r/vllm-router", "address": f"127.0.0.1:{up.port}", "mode": "pd"}],
                _pd_frontdoor_tls=variables["_pd_frontdoor_tls"])
        conf = (fd / "pd-frontdoor.conf").read_text()
        assert f"listen 127.0.0.1:{port} ssl;" in conf and f"ssl_certificate {fd}/tls/server.crt;" in conf
        ctx = ssl.create_default_context(cafile=str(ca_dir / "ca.crt"))
        with _nginx(fd, port):
            req = urllib.request.Request(f"https://127.0.0.1:{port}/v1/completions", data=b"{}", method="POST",
                                         headers={"Authorization": f"Bearer {KEY}"})
            with urllib.request.urlopen(req, timeout=20, context=ctx) as r:
                assert r.status == 200 and json.loads(r.read())["served_by"] == "pd"
            # A client that does not trust the bundle's CA is refused by its own TLS check.
            with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
                urllib.request.urlopen(req, timeout=20, context=ssl.create_default_context())
            # roles/pd_verify's package (urllib's default context) trusts the CA it gets as SSL_CERT_FILE (run.yml),
            # imported as run.yml runs it: a bare python3 in the directory that holds the package.
            probe = "import sys, pd_verify; print(pd_verify.http_get(sys.argv[1], api_key=sys.argv[2])[0])"
            url = f"https://127.0.0.1:{port}/v1/models"
            cases = (({"SSL_CERT_FILE": str(ca_dir / "ca.crt")}, "200"), ({}, "CERTIFICATE_VERIFY_FAILED"))
            for env, expected in cases:
                out = subprocess.run(["/usr/bin/python3", "-c", probe, url, KEY], cwd=ROOT / "roles/pd_verify/files",
                                     capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env},
                                     check=False, timeout=60)
                assert expected in out.stdout + out.stderr, out
    finally:
        up.close()


@pytest.mark.parametrize("url, allow, ok", [
    ("https://192.0.2.13:8000", False, True), ("http://127.0.0.1:8000", False, True),
    ("http://[::1]:8000", False, True), ("http://localhost:8000", False, True),
    ("http://192.0.2.13:8000", False, False), ("http://frontdoor.example:8000", False, False),
    ("http://10.237.0.13:8000", True, True), ("http://10.237.0.13:8000", "true", True),
    ("ftp://192.0.2.13", True, False), ("", False, False),
])
def test_a_client_key_never_goes_over_plain_http_to_another_host(url, allow, ok):
    if ok:
        assert pdf.pd_frontdoor_key_transport(url, allow, "pd_verify_router_url") == url
    else:
        with pytest.raises(ERR, match=r"pd_verify_router_url is .*(clear text|give the front door's URL)"):
            pdf.pd_frontdoor_key_transport(url, allow, "pd_verify_router_url")


def test_tls_names_and_upstreams_are_checked_where_they_are_written():
    assert pdf.pd_frontdoor_tls_sans("b300-03", "192.0.2.13") == "IP:192.0.2.13,DNS:b300-03,IP:127.0.0.1"
    assert pdf.pd_frontdoor_tls_sans("gpu_node_1", "fd.example") == "DNS:fd.example,IP:127.0.0.1"
    for bad in ("1.2.3.4\nsubjectAltName = DNS:evil", "1.2.3.4, DNS:evil", "1.2.3.4:80 ; server 6.6.6.6"):
        with pytest.raises(ERR, match="router host r1, field ansible_host"):
            pdf.pd_frontdoor_tls_sans("r1", bad)
    # Another router host's address becomes an nginx upstream line: the case is refused, naming the field.
    cluster = _cluster("r1", "r2")
    cluster["routers"][1]["address"] = "1.2.3.4:80 ; server 6.6.6.6"
    with pytest.raises(ERR, match="router host r2, field ansible_host.*neither an IP address nor a DNS name"):
        pdf.pd_frontdoor_backends(cluster, "r1", "0.0.0.0")  # noqa: S104 - compared, not bound
    cluster["routers"][1]["address"] = "fd00::2"
    assert [b["address"] for b in pdf.pd_frontdoor_backends(cluster, "r1", "0.0.0.0")][:2] == [  # noqa: S104
        "127.0.0.1:8001", "[fd00::2]:8001"]


@pytest.mark.parametrize("changes, refused", [
    ({}, "a client key would go over plain HTTP to 192.0.2.13 .*pd_frontdoor_allow_plain_http: true"),
    ({"pd_frontdoor_allow_plain_http": True}, None),
    ({"_url": "https://192.0.2.13:8000"}, None),
    ({"_url": "https://192.0.2.13:8000", "pd_frontdoor_requires_units": ["pd-firewall.service\nExecStartPre=/x"]},
     "pd_frontdoor_requires_units is"),
])
def test_validate_refuses_client_keys_over_plain_http(tmp_path, changes, refused):
    """The role's validate entry point (playbooks/validate.yml runs it for every router host): the front door's URL
    in the cluster view is plain http to a non-loopback address -> refused with the fix, unless the inventory says
    it is a test network."""
    url = changes.pop("_url", "http://192.0.2.13:8000")
    variables = {"pd_frontdoor_api_keys": [KEY], "pd_served_model_name": "tiny-pd", "pd_frontdoor_tls_enabled": False,
                 "pd_cluster": {"routers": [{"host": "localhost", "address": "192.0.2.13", "url": url,
                                             "units": _units((8001, "pd"))}]},
                 **changes}
    tasks = [{"name": "Validate", "ansible.builtin.include_role": {"name": "b300.pd.pd_frontdoor",
                                                                   "tasks_from": "validate"}}]
    p = _run_tasks(tmp_path, tasks, variables)
    if refused:
        assert p.returncode != 0 and re.search(refused, p.stdout), p.stdout[-3000:]
        assert KEY not in p.stdout
    else:
        assert p.returncode == 0, p.stdout[-3000:]
