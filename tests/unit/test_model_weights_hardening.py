"""Security review (issue 18) of model_weights: planted symlinks, a hub revision's local manifest, malformed hub
metadata / ENOSPC, and where the token may travel. Real servers on 127.0.0.1 (TLS with a throwaway certificate)."""

from __future__ import annotations

import errno
import json
import os

import pytest
from ansible_collections.b300.pd.plugins.module_utils import model_manifest as mm
from ansible_collections.b300.pd.plugins.module_utils.model_errors import UnsafePathError
from ansible_collections.b300.pd.plugins.module_utils.model_fetchers import PathFetcher
from ansible_collections.b300.pd.plugins.module_utils.model_nofollow import open_dir_beneath
from ansible_collections.b300.pd.tests.unit.test_model_weights import Server, args_for, make_model, make_tls_cert, run

REV = "0123456789abcdef0123456789abcdef01234567"
REPO = "zai-org/GLM-5.2-NVFP4"
LFS = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
TOKEN = "hf_secret_token"  # noqa: S105 (test token)


@pytest.fixture
def tls_cert(tmp_path, monkeypatch):
    pem = make_tls_cert(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(pem))
    return pem


@pytest.fixture
def servers():
    made = []
    yield made
    for s in made:
        s.close()


@pytest.fixture
def hub(tmp_path, tls_cert, servers):
    d = tmp_path / "hub"
    make_model(d)
    (d / "manifest.json").unlink()
    srv = Server(d, hub={"repo": REPO, "rev": REV, "api_sha": REV, "lfs": LFS}, token=TOKEN, tls_cert=tls_cert)
    servers.append(srv)
    return srv


def hub_args(tmp_path, srv, **kw):
    return args_for(tmp_path, {"type": "hf", "repo_id": REPO, "endpoint": srv.url}, REV, token=TOKEN, **kw)


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    return d, make_model(d)


@pytest.fixture
def outside(tmp_path):
    """A directory outside the model root with a file nobody may touch."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "victim").write_bytes(b"precious\n")
    return d


# ------------------------------------------------------------------ 1. planted symlinks are never followed


def test_planted_part_symlink_is_refused_not_appended_to(tmp_path, src, outside, monkeypatch):
    d, m = src
    part = tmp_path / "root" / ".staging" / m["revision"] / "config.json.part"
    part.parent.mkdir(parents=True)
    part.symlink_to(outside / "victim")
    a = args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"])
    for check in (True, False):
        res, failed = run(a, monkeypatch, check=check)
        assert failed, res
        assert f"{part} is a symlink (to {outside / 'victim'})" in res["msg"] and "rm " in res["msg"]
    assert (outside / "victim").read_bytes() == b"precious\n"
    assert part.is_symlink()  # named, not silently removed
    assert not (tmp_path / "root" / "served").exists()


def test_planted_directory_symlink_in_revision_is_not_written_through(tmp_path, src, outside, monkeypatch):
    d, m = src
    a = args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"])
    assert not run(a, monkeypatch)[1]
    tok = tmp_path / "root" / "revisions" / m["revision"] / "tokenizer"
    (tok / "tokenizer.json").unlink()
    tok.rmdir()
    tok.symlink_to(outside)
    res, failed = run(a, monkeypatch)
    assert failed, res
    assert f"{tok} is a symlink (to {outside})" in res["msg"]
    assert sorted(os.listdir(outside)) == ["victim"]  # no shard written into the outside directory


def test_symlinked_old_revision_is_named_not_pruned(tmp_path, src, outside, monkeypatch):
    d, m = src
    revs = tmp_path / "root" / "revisions"
    revs.mkdir(parents=True)
    (revs / ("f" * 64)).symlink_to(outside)
    res, failed = run(args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"], keep=1), monkeypatch)
    assert failed, res
    assert f"{revs / ('f' * 64)} is a symlink (to {outside})" in res["msg"]
    assert (outside / "victim").read_bytes() == b"precious\n"


def test_write_atomic_never_writes_through_a_planted_tmp_link(tmp_path, outside):
    # The temporary name is predictable (<path>.tmp-<pid>): a link planted there must not truncate its target.
    target = tmp_path / "manifest.json"
    (tmp_path / f"manifest.json.tmp-{os.getpid()}").symlink_to(outside / "victim")
    mm.write_atomic(str(target), "{}\n")
    assert target.read_text() == "{}\n" and not target.is_symlink()
    assert (outside / "victim").read_bytes() == b"precious\n"


def test_fetchers_refuse_a_part_that_is_a_symlink(tmp_path, src, outside):
    # The plan-time check can lose a race; the write itself must not follow a link either.
    d, m = src
    entry = next(f for f in m["files"] if f["path"] == "config.json")
    part = tmp_path / "config.json.part"
    part.symlink_to(outside / "victim")
    with pytest.raises(UnsafePathError, match="is a symlink"):
        PathFetcher(str(d)).fetch(entry, str(part))
    assert (outside / "victim").read_bytes() == b"precious\n"


def test_open_dir_beneath_refuses_a_symlinked_component(tmp_path, outside):
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "sub").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="is a symlink"):
        open_dir_beneath(str(tmp_path), "tree/sub/deeper", create=True)
    assert sorted(os.listdir(outside)) == ["victim"]


# ------------------------------------------------------------------ 2. a hub revision's local manifest


def drop_from_local_manifest(tmp_path, rel):
    mf = tmp_path / "root" / "revisions" / REV / "manifest.json"
    m = json.loads(mf.read_text())
    m["files"] = [f for f in m["files"] if f["path"] != rel]
    mf.write_text(json.dumps(m))


def test_edited_hub_manifest_does_not_delete_a_real_file(tmp_path, hub, monkeypatch):
    a = hub_args(tmp_path, hub)
    assert not run(a, monkeypatch)[1]
    drop_from_local_manifest(tmp_path, "config.json")
    res, failed = run(a, monkeypatch)
    assert not failed, res
    assert res["removed"] == []
    assert res["manifest_origin"] == f"{hub.url}/{REPO}@{REV}"  # the hub decided, not the edited file
    assert (tmp_path / "root" / "served" / "config.json").read_bytes() == (hub.root / "config.json").read_bytes()
    restored = json.loads((tmp_path / "root" / "served" / "manifest.json").read_text())
    assert "config.json" in {f["path"] for f in restored["files"]}
    assert res["summary"] == {"ok": 4} and res["transferred_bytes"] == 0


def test_edited_hub_manifest_with_hub_down_fails_and_deletes_nothing(tmp_path, hub, monkeypatch):
    a = hub_args(tmp_path, hub)
    assert not run(a, monkeypatch)[1]
    drop_from_local_manifest(tmp_path, "config.json")
    hub.close()
    res, failed = run(a, monkeypatch)
    assert failed, res
    assert "config.json" in res["msg"] and "could not confirm" in res["msg"]
    assert (tmp_path / "root" / "served" / "config.json").exists()


def test_real_stray_file_of_hub_revision_still_removed(tmp_path, hub, monkeypatch):
    a = hub_args(tmp_path, hub)
    assert not run(a, monkeypatch)[1]
    stray = tmp_path / "root" / "served" / "model-00003-of-00002.safetensors"
    stray.write_bytes(b"stale")
    res, failed = run(a, monkeypatch)
    assert not failed and res["removed"] == ["model-00003-of-00002.safetensors"] and not stray.exists()


# ------------------------------------------------------------------ 3. named errors instead of tracebacks


def _lfs_entry(info):
    return next(s for s in info["siblings"] if s.get("lfs"))


def _plain_entry(info):
    return next(s for s in info["siblings"] if s["rfilename"] == "config.json")


@pytest.mark.parametrize("patch,expect", [
    (lambda i: _lfs_entry(i)["lfs"].pop("sha256") and i, "lfs.sha256 is None"),
    (lambda i: _lfs_entry(i)["lfs"].update(size="big") or i, "lfs.size is 'big', not a byte count"),
    (lambda i: _plain_entry(i).update(size="n/a") or i, "config.json: size is 'n/a', not a byte count"),
    (lambda i: dict(i, siblings={s["rfilename"]: s for s in i["siblings"]}), "'siblings' is a dict, not a list"),
    (lambda i: dict(i, siblings="model.safetensors"), "'siblings' is a str, not a list"),
    (lambda i: [i], "is a JSON list, not an object"),
], ids=["no-sha256", "lfs-size-text", "size-text", "siblings-dict", "siblings-str", "not-an-object"])
def test_malformed_hub_metadata_is_a_named_error(tmp_path, hub, monkeypatch, patch, expect):
    hub.patch_info = patch
    res, failed = run(hub_args(tmp_path, hub), monkeypatch)
    assert failed, res
    assert expect in res["msg"], res["msg"]
    assert "source.endpoint must be a Hugging Face hub API" in res["msg"]  # the fix
    assert not (tmp_path / "root" / "served").exists()


def test_enospc_writing_manifest_is_a_named_error(tmp_path, src, monkeypatch):
    d, m = src
    real_fsync = os.fsync

    def full_disk_for_manifest(fd):
        # ENOSPC as delayed allocation reports it (at fsync), only for the manifest's temporary file
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("manifest.json.tmp-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk_for_manifest)
    res, failed = run(args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"]), monkeypatch)
    assert failed, res
    assert "manifest.json" in res["msg"] and "No space left on device" in res["msg"]
    assert "the filesystem is full: free space there" in res["msg"]
    revdir = tmp_path / "root" / "revisions" / m["revision"]
    assert not [p for p in os.listdir(revdir) if ".tmp-" in p]  # no half-written temporary left behind


def test_unknown_owner_is_named(tmp_path, src, monkeypatch):
    d, m = src
    res, failed = run(args_for(tmp_path, {"type": "path", "path": str(d)}, m["revision"],
                               owner="no-such-user-b300"), monkeypatch)
    assert failed and "owner 'no-such-user-b300' is not a user on this host" in res["msg"]


# ------------------------------------------------------------------ 4. where the token may travel


@pytest.mark.parametrize("which", ["api", "file"])
def test_https_to_http_redirect_on_same_host_is_refused(tmp_path, hub, monkeypatch, which):
    api = f"/api/models/{REPO}/revision/{REV}?blobs=true"
    if which == "api":
        hub.redirects[api] = hub.plain_url + api
    else:
        path = f"/{REPO}/resolve/{REV}/config.json"
        hub.redirects[path] = hub.plain_url + path
    res, failed = run(hub_args(tmp_path, hub, download_workers=1), monkeypatch)
    assert failed, res
    assert "refused the redirect" in res["msg"] and "leaves https" in res["msg"]
    assert hub.plain_auth == []  # not a single request over plain HTTP, so the token never left TLS
    assert TOKEN not in json.dumps(res)


@pytest.mark.parametrize("source", [
    {"type": "http", "url": "http://mirror.example:8080/glm"},
    {"type": "hf", "repo_id": REPO, "endpoint": "http://hub.example"},
], ids=["http-mirror", "http-hub-endpoint"])
def test_plain_http_source_with_token_refused_before_anything(tmp_path, monkeypatch, source):
    res, failed = run(args_for(tmp_path, source, REV, token=TOKEN), monkeypatch)
    assert failed, res
    field = "source.url" if source["type"] == "http" else "source.endpoint"
    assert f"{field} http://" in res["msg"] and "token" in res["msg"] and "clear text" in res["msg"]
    assert not (tmp_path / "root").exists()


def test_plain_http_mirror_without_token_still_works(tmp_path, src, monkeypatch, servers):
    d, m = src
    srv = Server(d)
    servers.append(srv)
    res, failed = run(args_for(tmp_path, {"type": "http", "url": srv.url}, m["revision"]), monkeypatch)
    assert not failed, res
    assert srv.plain_auth and set(srv.plain_auth) == {None}
