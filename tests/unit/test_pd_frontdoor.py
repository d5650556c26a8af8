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


def _render(tmp: Path, port: int, backends: list[dict], **extra) -> None:
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    # nginx config, not HTML: nothing to escape (Ansible renders it the same way).
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(ROLE / "templates")), keep_trailing_newline=True,  # noqa: S701
                             undefined=jinja2.StrictUndefined)
    env.filters["bool"] = lambda v: str(v).lower() in ("1", "true", "yes")
    env.filters["b300.pd.pd_frontdoor_key_map"] = pdf.pd_frontdoor_key_map
    admission = extra.pop("admission", {})
    ctx = {**{k: v for k, v in defaults.items() if not isinstance(v, str) or "{{" not in v},
           "ansible_managed": "test", "pd_frontdoor_port": port, "pd_frontdoor_bind_host": "127.0.0.1",
           "pd_frontdoor_listen_ipv6": False, "pd_frontdoor_request_timeout_s": 30,
           "pd_frontdoor_config_dir": str(tmp), "pd_frontdoor_access_log": str(tmp / "access.log"),
           "_pd_frontdoor_backends": backends, "pd_frontdoor_api_keys": [KEY, KEY2], "pd_frontdoor_model": "tiny-pd",
           "_pd_frontdoor_admission": pdf.pd_frontdoor_admission(
               admission.get("max_inflight", 0), admission.get("max_rate", 0), admission.get("share", 0.5),
               admission.get("reserve", 0.5), admission.get("body", ""), admission.get("max_model_len", 4096)),
           "pd_frontdoor_gate_port": _free_port(),
           **extra}
    (tmp / "pd-frontdoor.conf").write_text(env.get_template("pd-frontdoor.conf.j2").render(**ctx))
    (tmp / "api-keys.map").write_text(env.get_template("api-keys.map.j2").render(**ctx))
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
    assert all(s["auth"] is None for u in frontdoor["ups"].values() for s in u.seen)  # the key stops at the door
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
            pd_frontdoor_tls_certificate=str(cert), pd_frontdoor_tls_certificate_key=str(key))
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
    # tasks/main.yml, run by ansible-playbook against a copy of this machine's Debian nginx.conf.
    tasks = yaml.safe_load((ROLE / "tasks" / "main.yml").read_text())
    edits = [t for t in tasks if t.get("ansible.builtin.lineinfile", {}).get("path") == "/etc/nginx/nginx.conf"]
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
           "ANSIBLE_FACT_CACHING": "memory"}

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
        assert all(s["auth"] is None for s in up.seen)  # nor the key, through the gate either
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
