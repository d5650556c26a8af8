"""plugins/modules/model_weights.py through its main() (Ansible's module test pattern) and once through
`ansible localhost`.

Sources: `path` (real directory), `http` and `hf` (a real stdlib HTTP server in a thread that mimics a mirror and
the hub's /api/models/<repo>/revision/<rev>?blobs=true and /<repo>/resolve/<rev>/<file> endpoints: the real hub
is unreachable from CI), `peer` (real rsync between two local directories).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from ansible_collections.b300.pd.plugins.module_utils import model_manifest as mm
from ansible_collections.b300.pd.plugins.module_utils.model_disk_space import human_bytes
from ansible_collections.b300.pd.tests.unit.pd_testlib import ROOT, load_library, run_module

model_weights = load_library("model_weights")

MIB = 1024 * 1024


def make_model(d: Path, sizes=None, revision=None):
    sizes = sizes or {"model-00001-of-00002.safetensors": 3 * MIB + 5, "model-00002-of-00002.safetensors": 2 * MIB,
                      "config.json": 64, "tokenizer/tokenizer.json": 900}
    d.mkdir(parents=True, exist_ok=True)
    for rel, size in sizes.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(size))
    m = mm.build_manifest(d, revision=revision)
    (d / "manifest.json").write_text(mm.dumps_manifest(m))
    return m


def args_for(tmp_path, source, revision, **kw):
    a = {"root": str(tmp_path / "root"), "link": str(tmp_path / "root" / "served"), "revision": revision,
         "source": source, "buffer_size_mib": 1, "space_margin_mib": 0, "retries": 0}
    a.update(kw)
    return a


def run(args, monkeypatch, check=False, diff=False):
    return run_module(model_weights.main, args, check_mode=check, diff=diff, monkeypatch=monkeypatch)


def tree(path: Path):
    """Every path under path with (type, size, mtime_ns, content digest): detects any write."""
    out = {}
    if not path.exists():
        return out
    for p in sorted(path.rglob("*")):
        st = p.lstat()
        if p.is_symlink():
            digest = os.readlink(p)
        elif p.is_file():
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            digest = ""
        out[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    return d, make_model(d)


# ------------------------------------------------------------------ HTTP server (mirror + hub)


def make_tls_cert(d: Path) -> Path:
    """A self-signed certificate (with its key) for 127.0.0.1; clients trust it through SSL_CERT_FILE."""
    pem = d / "localhost.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(pem), "-out", str(pem)],
                   check=True, capture_output=True)
    return pem


@pytest.fixture
def tls_cert(tmp_path, monkeypatch):
    pem = make_tls_cert(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(pem))  # urllib's default context reads it per connection
    return pem


class _DualServer(ThreadingHTTPServer):
    """With a TLS context: TLS and plain HTTP on one port (a ClientHello starts with 0x16), so a redirect from
    https://127.0.0.1:P to http://127.0.0.1:P keeps host and port, as a same-host downgrade does on 443/80."""

    ssl_context = None

    def get_request(self):
        sock, addr = super().get_request()
        if self.ssl_context is not None:
            sock.settimeout(5)
            try:
                first = sock.recv(1, socket.MSG_PEEK)
            finally:
                sock.settimeout(None)
            if first == b"\x16":
                sock = self.ssl_context.wrap_socket(sock, server_side=True)
        return sock, addr


class Server:
    """Serves files from a directory with Range support; counts body bytes served per path; can cut a response."""

    def __init__(self, root: Path, hub: dict | None = None, token: str | None = None, tls_cert: Path | None = None):
        self.root = root
        self.hub = hub  # {"repo": ..., "rev": ..., "api_sha": ..., "lfs": set(paths)}
        self.token = token
        self.served: dict[str, int] = {}
        self.ranges: list[str | None] = []
        self.auth_seen: list[str | None] = []
        self.plain_auth: list[str | None] = []  # Authorization of requests that came over plain HTTP
        self.redirects: dict[str, str] = {}  # request path (query included) -> Location of a 302
        self.patch_info = None  # callable(hub_info) -> what the API returns instead
        self.cut_after: dict[str, int] = {}  # path -> bytes, applied once
        self.ignore_range = False
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.auth_seen.append(self.headers.get("Authorization"))
                if not isinstance(self.connection, ssl.SSLSocket):
                    outer.plain_auth.append(self.headers.get("Authorization"))
                if self.path in outer.redirects:
                    self.send_response(302)
                    self.send_header("Location", outer.redirects[self.path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if outer.token and self.headers.get("Authorization") != f"Bearer {outer.token}":
                    self.send_error(401)
                    return
                path = self.path.split("?")[0]
                if outer.hub:
                    api = f"/api/models/{outer.hub['repo']}/revision/{outer.hub['rev']}"
                    if path == api:
                        info = outer.hub_info()
                        return self._json(outer.patch_info(info) if outer.patch_info else info)
                    prefix = f"/{outer.hub['repo']}/resolve/{outer.hub['rev']}/"
                    if not path.startswith(prefix):
                        self.send_error(404)
                        return
                    rel = path[len(prefix):]
                else:
                    rel = path.lstrip("/")
                f = outer.root / rel
                if not f.is_file():
                    self.send_error(404)
                    return
                data = f.read_bytes()
                rng = self.headers.get("Range")
                outer.ranges.append(rng)
                start = 0
                if rng and not outer.ignore_range:
                    start = int(re.match(r"bytes=(\d+)-$", rng).group(1))
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                cut = outer.cut_after.pop(rel, None)
                if cut is not None:
                    body = body[:cut]
                self.wfile.write(body)
                outer.served[rel] = outer.served.get(rel, 0) + len(body)
                if cut is not None:
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)

            def _json(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = _DualServer(("127.0.0.1", 0), H)
        port = self.httpd.server_address[1]
        self.plain_url = f"http://127.0.0.1:{port}"
        self.url = self.plain_url
        if tls_cert is not None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(tls_cert)
            self.httpd.ssl_context = ctx
            self.url = f"https://127.0.0.1:{port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def hub_info(self):
        siblings = [{"rfilename": ".gitattributes", "blobId": "1" * 40, "size": 10}]
        for p in sorted(x for x in self.root.rglob("*") if x.is_file() and x.name != "manifest.json"):
            rel = str(p.relative_to(self.root))
            data = p.read_bytes()
            if rel in self.hub["lfs"]:
                lfs = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                siblings.append({"rfilename": rel, "blobId": "2" * 40, "size": 134, "lfs": lfs})
            else:
                blob = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
                siblings.append({"rfilename": rel, "blobId": blob, "size": len(data)})
        return {"id": self.hub["repo"], "sha": self.hub["api_sha"], "siblings": siblings}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server_factory():
    servers = []

    def make(*a, **kw):
        s = Server(*a, **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


# ------------------------------------------------------------------ path source: fetch, idempotence, layout


def test_fresh_fetch_then_idempotent(tmp_path, src, monkeypatch):
    d, m = src
    a = args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"])
    res, failed = run(a, monkeypatch)
    assert not failed, res
    assert res["changed"] is True
    assert res["summary"] == {"fetched": 4}
    assert res["transferred_bytes"] == sum(f["size"] for f in m["files"])
    link = tmp_path / "root" / "served"
    assert os.readlink(link) == f"revisions/{m['revision']}"  # relative: survives bind-mounting the root elsewhere
    for f in m["files"]:
        served = link / f["path"]
        assert served.read_bytes() == (d / f["path"]).read_bytes()
        assert served.stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "root" / "revisions").stat().st_mode & 0o777 == 0o755
    assert json.loads((link / "manifest.json").read_text()) == m
    assert not (tmp_path / "root" / ".staging" / m["revision"]).exists()

    before = tree(tmp_path / "root" / "revisions")
    res2, failed = run(a, monkeypatch)
    assert not failed
    assert res2["changed"] is False
    assert res2["summary"] == {"ok": 4}
    assert res2["manifest_origin"] == "local"  # a healthy host does not need the source
    assert res2["transferred_bytes"] == 0
    assert tree(tmp_path / "root" / "revisions") == before


def test_healthy_host_does_not_need_the_source(tmp_path, src, monkeypatch):
    d, m = src
    a = args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"])
    assert run(a, monkeypatch)[0]["changed"]
    shutil.rmtree(d)  # source gone (hub outage at 3 a.m.)
    res, failed = run(a, monkeypatch)
    assert not failed and res["changed"] is False


# ------------------------------------------------------------------ corruption is detected and repaired


@pytest.mark.parametrize("damage,state", [("flip", "checksum_mismatch"), ("truncate", "size_mismatch"),
                                          ("delete", "missing")])
def test_corrupted_served_shard_detected_and_repaired(tmp_path, src, monkeypatch, damage, state):
    d, m = src
    a = args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"])
    run(a, monkeypatch)
    shard = tmp_path / "root" / "served" / "model-00001-of-00002.safetensors"
    good = shard.read_bytes()
    if damage == "flip":
        with open(shard, "r+b") as f:
            f.seek(2 * MIB)
            f.write(bytes([good[2 * MIB] ^ 0x01]))
    elif damage == "truncate":
        os.truncate(shard, MIB)
    else:
        shard.unlink()

    # check mode reports it and touches nothing
    before = tree(tmp_path / "root")
    res, failed = run(a, monkeypatch, check=True)
    assert not failed
    assert res["changed"] is True
    states = {f["path"]: f["state"] for f in res["files"]}
    assert states["model-00001-of-00002.safetensors"] == state
    assert [s for p, s in states.items() if p != "model-00001-of-00002.safetensors"] == ["ok"] * 3
    assert res["fetch_bytes"] == len(good)
    assert tree(tmp_path / "root") == before

    res, failed = run(a, monkeypatch)
    assert not failed, res
    assert res["changed"] is True
    expected = "fetched" if damage == "delete" else "repaired"
    assert {f["path"]: f["state"] for f in res["files"]}["model-00001-of-00002.safetensors"] == expected
    assert shard.read_bytes() == good
    assert run(a, monkeypatch)[0]["changed"] is False


def test_corrupt_source_fails_and_keeps_served_file(tmp_path, src, monkeypatch):
    d, m = src
    a = args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"])
    run(a, monkeypatch)
    served = tmp_path / "root" / "served" / "config.json"
    served.write_bytes(b"x" * 64)  # corrupt locally ...
    (d / "config.json").write_bytes(b"y" * 64)  # ... and at the source
    res, failed = run(a, monkeypatch)
    assert failed
    assert "config.json" in res["msg"] and "does not match the manifest after a full re-fetch" in res["msg"]
    assert served.read_bytes() == b"x" * 64  # nothing half-copied was moved into place


def test_extra_files_in_revision_removed(tmp_path, src, monkeypatch):
    d, m = src
    a = args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"])
    run(a, monkeypatch)
    stray = tmp_path / "root" / "served" / "model-00003-of-00002.safetensors"
    stray.write_bytes(b"stale")  # vLLM would try to load it
    res, _failed = run(a, monkeypatch)
    assert res["changed"] is True and res["removed"] == ["model-00003-of-00002.safetensors"]
    assert not stray.exists()


# ------------------------------------------------------------------ resume


def test_interrupted_local_copy_resumes(tmp_path, src, monkeypatch):
    d, m = src
    rev = m["revision"]
    shard = "model-00001-of-00002.safetensors"
    data = (d / shard).read_bytes()
    part = tmp_path / "root" / ".staging" / rev / (shard + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(data[: 2 * MIB])  # a copy killed after 2 MiB
    a = args_for(tmp_path, {"type": "path", "path": str(d)}, rev)
    res, _failed = run(a, monkeypatch, check=True)
    assert res["fetch_bytes"] == sum(f["size"] for f in m["files"]) - 2 * MIB
    res, failed = run(a, monkeypatch)
    assert not failed
    assert res["transferred_bytes"] == sum(f["size"] for f in m["files"]) - 2 * MIB
    assert (tmp_path / "root" / "served" / shard).read_bytes() == data
    assert not part.exists()


def test_corrupt_partial_prefix_is_refetched_from_zero(tmp_path, src, monkeypatch):
    d, m = src
    shard = "model-00001-of-00002.safetensors"
    data = (d / shard).read_bytes()
    part = tmp_path / "root" / ".staging" / m["revision"] / (shard + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * MIB)  # wrong bytes: appending to them cannot verify
    res, failed = run(args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"]), monkeypatch)
    assert not failed, res
    assert (tmp_path / "root" / "served" / shard).read_bytes() == data


def test_http_fetch_killed_midway_resumes_without_refetching(tmp_path, src, monkeypatch, server_factory):
    d, m = src
    srv = server_factory(d)
    shard = "model-00001-of-00002.safetensors"
    size = (d / shard).stat().st_size
    srv.cut_after[shard] = 1_234_567  # the connection dies after 1.2 MB
    a = args_for(tmp_path, {"type": "http", "url": srv.url}, m["revision"], download_workers=1)
    res, failed = run(a, monkeypatch)
    assert failed
    assert shard in res["msg"] and "resumed next run" in res["msg"]
    part = tmp_path / "root" / ".staging" / m["revision"] / (shard + ".part")
    assert part.stat().st_size == 1_234_567
    assert not (tmp_path / "root" / "served").exists()  # nothing served from a half-fetched revision
    assert not (tmp_path / "root" / "revisions" / m["revision"] / shard).exists()

    res, failed = run(a, monkeypatch)
    assert not failed, res
    assert srv.served[shard] == size  # 1_234_567 + the rest: no byte served twice
    assert "bytes=1234567-" in srv.ranges
    assert (tmp_path / "root" / "served" / shard).read_bytes() == (d / shard).read_bytes()
    assert {f["path"]: f["state"] for f in res["files"]}[shard] == "fetched"


def test_http_retry_within_one_run_resumes(tmp_path, src, monkeypatch, server_factory):
    d, m = src
    srv = server_factory(d)
    shard = "model-00002-of-00002.safetensors"
    srv.cut_after[shard] = 500_000
    a = args_for(tmp_path, {"type": "http", "url": srv.url}, m["revision"], retries=2)
    res, failed = run(a, monkeypatch)
    assert not failed, res
    assert srv.served[shard] == 2 * MIB
    assert res["transferred_bytes"] == sum(f["size"] for f in m["files"])


def test_http_server_ignoring_range_restarts_cleanly(tmp_path, src, monkeypatch, server_factory):
    d, m = src
    srv = server_factory(d)
    srv.ignore_range = True
    shard = "model-00001-of-00002.safetensors"
    part = tmp_path / "root" / ".staging" / m["revision"] / (shard + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes((d / shard).read_bytes()[:MIB])
    res, failed = run(args_for(tmp_path, {"type": "http", "url": srv.url}, m["revision"]), monkeypatch)
    assert not failed, res
    assert (tmp_path / "root" / "served" / shard).read_bytes() == (d / shard).read_bytes()


# ------------------------------------------------------------------ revision pinning


def test_wrong_revision_fails_clearly_and_writes_nothing(tmp_path, src, monkeypatch):
    d, m = src
    wanted = "f" * 64
    res, failed = run(args_for(tmp_path, {"type": "path", "path": str(d)}, wanted), monkeypatch)
    assert failed
    assert f"revision mismatch: source {d} has revision {m['revision']} but {wanted} was requested" in res["msg"]
    assert not (tmp_path / "root").exists()


def test_edited_manifest_fails_content_revision(tmp_path, src, monkeypatch):
    d, m = src
    m2 = json.loads((d / "manifest.json").read_text())
    m2["files"][0]["size"] += 1
    (d / "manifest.json").write_text(json.dumps(m2))
    res, failed = run(args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"]), monkeypatch)
    assert failed and "hashes to" in res["msg"]
    assert not (tmp_path / "root").exists()


# ------------------------------------------------------------------ disk preflight, check mode


def test_disk_preflight_fails_before_any_write(tmp_path, src, monkeypatch):
    d, m = src
    total = sum(f["size"] for f in m["files"])
    real = os.statvfs

    class Fake:
        def __init__(self, st):
            self.f_frsize = 4096
            self.f_bavail = (total // 2) // 4096  # half of what is needed
            self.f_bsize = st.f_bsize

    monkeypatch.setattr(os, "statvfs", lambda p: Fake(real(p)))
    a = args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"], space_margin_mib=1)
    res, failed = run(a, monkeypatch)
    assert failed
    assert f"under {tmp_path / 'root'} (filesystem of {tmp_path})" in res["msg"]
    free = ((total // 2) // 4096) * 4096
    short = total + MIB - free
    assert f"short by {human_bytes(short)}" in res["msg"]
    assert not (tmp_path / "root").exists()  # nothing created: not the root, not .staging, not the lock


def test_check_mode_touches_nothing_and_counts_bytes(tmp_path, src, monkeypatch):
    d, m = src
    a = args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"])
    res, failed = run(a, monkeypatch, check=True, diff=True)
    assert not failed
    assert res["changed"] is True
    assert res["summary"] == {"missing": 4}
    assert res["fetch_bytes"] == sum(f["size"] for f in m["files"])
    assert res["transferred_bytes"] == 0
    assert res["diff"]["after"]["target"] == f"revisions/{m['revision']}"
    assert not (tmp_path / "root").exists()


# ------------------------------------------------------------------ atomic switch, keep, rollback


def test_switch_is_atomic_and_old_revisions_pruned(tmp_path, monkeypatch):
    revs = []
    for i in range(3):
        d = tmp_path / f"src{i}"
        revs.append((d, make_model(d, {"model.safetensors": 300_000 + i, "config.json": 10})["revision"]))
    link = tmp_path / "root" / "served"

    def go(i, **kw):
        res, failed = run(args_for(tmp_path, {"type": "path", "path": str(revs[i][0])}, revs[i][1], **kw), monkeypatch)
        assert not failed, res
        return res

    go(0)
    go(1)
    assert sorted(os.listdir(tmp_path / "root" / "revisions")) == sorted([revs[0][1], revs[1][1]])
    res = go(2)
    assert res["pruned"] == [revs[0][1]]
    assert sorted(os.listdir(tmp_path / "root" / "revisions")) == sorted([revs[1][1], revs[2][1]])
    assert os.readlink(link) == f"revisions/{revs[2][1]}"
    # rollback to the kept revision: no fetch, just the switch
    res = go(1)
    assert res["transferred_bytes"] == 0 and res["changed"] is True and res["pruned"] == []
    assert os.readlink(link) == f"revisions/{revs[1][1]}"

    # A reader polling the served path while it flips back and forth never sees it missing.
    stop = threading.Event()
    errors = []
    reads = [0]

    def reader():
        while not stop.is_set():
            try:
                os.readlink(link)
                (link / "config.json").stat()
                reads[0] += 1
            except OSError as e:
                errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for k in range(20):
            go(2 if k % 2 == 0 else 1, verify="size")
    finally:
        stop.set()
        t.join()
    assert errors == []
    assert reads[0] > 0
    assert not [p for p in os.listdir(tmp_path / "root") if ".tmp-" in p]


def test_keep_one_deletes_previous(tmp_path, monkeypatch):
    d0, d1 = tmp_path / "a", tmp_path / "b"
    r0 = make_model(d0, {"x.bin": 100})["revision"]
    r1 = make_model(d1, {"x.bin": 101})["revision"]
    run(args_for(tmp_path, {"type": "path", "path": str(d0)}, r0, keep=1), monkeypatch)
    res, _failed = run(args_for(tmp_path, {"type": "path", "path": str(d1)}, r1, keep=1), monkeypatch)
    assert res["pruned"] == [r0]
    assert os.listdir(tmp_path / "root" / "revisions") == [r1]


def test_real_directory_at_link_is_refused(tmp_path, src, monkeypatch):
    d, m = src
    (tmp_path / "root" / "served").mkdir(parents=True)
    res, failed = run(args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"]), monkeypatch)
    assert failed and "exists and is not a symlink" in res["msg"]


# ------------------------------------------------------------------ hf (hub-shaped local server) and peer


def test_hf_source_with_token_and_git_blob_files(tmp_path, monkeypatch, server_factory, tls_cert):
    d = tmp_path / "hub"
    make_model(d)
    (d / "manifest.json").unlink()  # the hub has no manifest.json: the module builds it from the API
    rev = "0123456789abcdef0123456789abcdef01234567"
    srv = server_factory(d, hub={"repo": "zai-org/GLM-5.2-NVFP4", "rev": rev, "api_sha": rev,
                                 "lfs": {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}},
                         token="hf_secret_token", tls_cert=tls_cert)  # noqa: S106 (test token)
    a = args_for(tmp_path, {"type": "hf", "repo_id": "zai-org/GLM-5.2-NVFP4", "endpoint": srv.url}, rev,
                 token="hf_secret_token")  # noqa: S106 (test token)
    res, failed = run(a, monkeypatch)
    assert not failed, res
    assert res["summary"] == {"fetched": 4}
    assert "hf_secret_token" not in json.dumps(res)
    assert set(srv.auth_seen) == {"Bearer hf_secret_token"}
    assert srv.plain_auth == []  # the token only ever went over TLS
    written = json.loads((tmp_path / "root" / "served" / "manifest.json").read_text())
    assert written["revision"] == rev
    assert {f["path"]: f["sha256"] for f in written["files"]} == {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in d.rglob("*") if p.is_file()
    }
    # second run: healthy, no hub traffic
    n = len(srv.auth_seen)
    assert run(a, monkeypatch)[0]["changed"] is False
    assert len(srv.auth_seen) == n
    # a non-LFS file corrupted locally is repaired against its git blob id from the hub
    (tmp_path / "root" / "served" / "config.json").write_bytes(os.urandom(64))
    res, failed = run(a, monkeypatch)
    assert not failed and {f["path"]: f["state"] for f in res["files"]}["config.json"] == "repaired"
    assert run(a, monkeypatch)[0]["changed"] is False


def test_hf_revision_must_be_a_commit_and_match_the_hub(tmp_path, monkeypatch, server_factory):
    d = tmp_path / "hub"
    make_model(d, {"a.safetensors": 10})
    res, failed = run(args_for(tmp_path, {"type": "hf", "repo_id": "o/r"}, "main"), monkeypatch)
    assert failed and "must be a full 40-hex commit id" in res["msg"]
    rev = "a" * 40
    srv = server_factory(d, hub={"repo": "o/r", "rev": rev, "api_sha": "b" * 40, "lfs": {"a.safetensors"}})
    res, failed = run(args_for(tmp_path, {"type": "hf", "repo_id": "o/r", "endpoint": srv.url}, rev), monkeypatch)
    assert failed and f"revision mismatch: the hub resolves o/r@{rev} to commit {'b' * 40}" in res["msg"]
    assert not (tmp_path / "root").exists()


@pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync not installed")
def test_peer_source_rsync_between_two_roots(tmp_path, src, monkeypatch):
    d, m = src
    rev = m["revision"]
    first = args_for(tmp_path / "host1", {"type": "path", "path": str(d)}, rev)
    (tmp_path / "host1").mkdir()
    assert not run(first, monkeypatch)[1]
    peer_dir = tmp_path / "host1" / "root" / "revisions" / rev
    shard = "model-00001-of-00002.safetensors"
    data = (d / shard).read_bytes()
    # host 2 had an interrupted rsync of one shard
    part = tmp_path / "host2" / "root" / ".staging" / rev / (shard + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(data[:MIB])
    second = args_for(tmp_path / "host2", {"type": "peer", "path": str(peer_dir)}, rev)
    res, failed = run(second, monkeypatch)
    assert not failed, res
    assert res["manifest_origin"] == str(peer_dir)
    assert res["transferred_bytes"] == sum(f["size"] for f in m["files"]) - MIB
    assert (tmp_path / "host2" / "root" / "served" / shard).read_bytes() == data
    assert run(second, monkeypatch)[0]["changed"] is False


# ------------------------------------------------------------------ through ansible itself


def test_ansible_adhoc_run_and_idempotence(tmp_path, src):
    d, m = src
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_STDOUT_CALLBACK="ansible.builtin.json",
               ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ANSIBLE_CACHE_PLUGIN="memory")
    args = json.dumps({"root": str(tmp_path / "root"), "link": str(tmp_path / "root" / "served"),
                       "revision": m["revision"], "source": {"type": "path", "path": str(d)}})
    cmd = [str(ROOT / ".venv" / "bin" / "ansible"), "localhost", "-i", "localhost,", "-c", "local",
           "-e", "ansible_python_interpreter=" + shutil.which("python3"), "-m", "b300.pd.model_weights", "-a", args]

    def once():
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
        assert p.returncode == 0, p.stdout + p.stderr
        # the json callback's document sits between profile_tasks' banner and its summary
        out, _end = json.JSONDecoder().raw_decode(p.stdout[p.stdout.index("{"):])
        return out["plays"][0]["tasks"][0]["hosts"]["localhost"]

    r1 = once()
    assert r1["changed"] is True and r1["summary"] == {"fetched": 4}
    r2 = once()
    assert r2["changed"] is False and r2["summary"] == {"ok": 4}


# ------------------------------------------------------------------ the role, through ansible-playbook


def _playbook(tmp: Path, extra_vars: dict, check=False):
    pb = tmp / "site.yml"
    pb.write_text("- name: Model weights\n  hosts: all\n  gather_facts: false\n"
                  "  roles:\n    - role: b300.pd.model_weights\n")
    # A tiny model fetches in seconds: bound the async job so a lost one fails the test instead of hanging it.
    (tmp / "vars.json").write_text(json.dumps({"model_weights_async_timeout": 600, **extra_vars}))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_CACHE_PLUGIN="memory")
    cmd = [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", "localhost,", "-c", "local",
           "-e", "ansible_python_interpreter=" + shutil.which("python3"), "-e", f"@{tmp / 'vars.json'}", str(pb)]
    if check:
        cmd += ["--check", "--diff"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False, timeout=1200)
    m = re.search(r"localhost\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", p.stdout)
    assert m, p.stdout[-3000:] + p.stderr[-3000:]
    return p, int(m.group(2)), int(m.group(4))


@pytest.fixture
def world_readable_tmp():
    # /tmp/pytest-of-root is 0700: the role's "vLLM user can read the model" check needs readable parents.
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="model-weights-role-", dir="/var/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_role_local_path_source_idempotent_and_check_mode(world_readable_tmp):
    tmp = world_readable_tmp
    m = make_model(tmp / "src")
    for p in [tmp / "src", *list((tmp / "src").rglob("*"))]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    v = {"pd_model_root": str(tmp / "models"), "pd_model_path": str(tmp / "models" / "tiny-pd"),
         "pd_model_source": {"type": "path", "path": str(tmp / "src"), "revision": m["revision"]},
         "pd_vllm_user": "nobody", "model_weights_space_margin_mib": 0, "model_weights_async_poll": 1,
         "pd_control_dir": str(tmp / "control")}
    p, changed, failed = _playbook(tmp, v, check=True)
    assert failed == 0, p.stdout[-3000:]
    assert not (tmp / "models" / "revisions" / m["revision"]).exists()  # check mode fetched nothing
    pin = tmp / "control" / ".cache" / "weights" / f"tiny-pd@{m['revision']}.manifest.json"
    assert not pin.exists()  # nor pinned anything
    p, changed, failed = _playbook(tmp, v)
    assert failed == 0 and changed >= 1, p.stdout[-3000:]
    assert os.readlink(tmp / "models" / "tiny-pd") == f"revisions/{m['revision']}"
    assert '{"fetched": 4}' in re.sub(r"\s+", " ", p.stdout)  # the role's summary line
    assert json.loads(pin.read_text()) == m  # the first verified download, pinned on the control node
    p, changed, failed = _playbook(tmp, v)
    assert (changed, failed) == (0, 0), p.stdout[-3000:]
    p, changed, failed = _playbook(tmp, v, check=True)
    assert (changed, failed) == (0, 0), p.stdout[-3000:]


def test_role_refuses_placeholder_hf_revision(world_readable_tmp):
    tmp = world_readable_tmp
    v = {"pd_model_root": str(tmp / "models"), "pd_model_path": str(tmp / "models" / "glm"),
         "pd_model_source": {"type": "hf", "repo_id": "org/GLM-5.2-NVFP4", "revision": "SET-ME-40-HEX-COMMIT"}}
    p, changed, failed = _playbook(tmp, v)
    assert failed == 1
    assert "must be the full 40-hex commit of org/GLM-5.2-NVFP4" in p.stdout
    assert not (tmp / "models").exists()


def test_source_revision_must_equal_revision(tmp_path, src, monkeypatch):
    d, m = src
    res, failed = run(args_for(tmp_path, {"type": "path", "path": str(d), "revision": "0" * 64}, m["revision"]),
                      monkeypatch)
    assert failed and f"source.revision {'0' * 64} differs from revision {m['revision']}" in res["msg"]
    assert not (tmp_path / "root").exists()
