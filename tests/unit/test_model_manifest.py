"""plugins/module_utils/model_manifest.py and scripts/model-manifest: manifest format, content revision, verification,
path / rsync fetchers resuming by byte offset. Real files, real threads, real rsync."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
from ansible_collections.b300.pd.plugins.module_utils import model_manifest as mm
from ansible_collections.b300.pd.plugins.module_utils.model_disk_space import free_bytes
from ansible_collections.b300.pd.plugins.module_utils.model_errors import ManifestError
from ansible_collections.b300.pd.plugins.module_utils.model_fetchers import PathFetcher, RsyncFetcher
from ansible_collections.b300.pd.plugins.module_utils.model_hashing import DEFAULT_BUFSIZE
from ansible_collections.b300.pd.tests.unit.pd_testlib import ROOT

CLI = ROOT / "scripts" / "model-manifest"


def make_model(d, sizes=None):
    """A shard-like model directory with random content; returns {relpath: bytes}."""
    sizes = sizes or {"model-00001-of-00002.safetensors": 3 * 1024 * 1024 + 17,
                      "model-00002-of-00002.safetensors": 1 << 20, "config.json": 40, "tokenizer/tokenizer.json": 1000}
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for rel, size in sizes.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        data = os.urandom(size)
        p.write_bytes(data)
        out[rel] = data
    return out


def real_run_command(argv):
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    return p.returncode, p.stdout, p.stderr


# ------------------------------------------------------------------ manifest + revision


def test_build_manifest_matches_independent_hashes(tmp_path):
    data = make_model(tmp_path / "m")
    (tmp_path / "m" / "leftover.part").write_bytes(b"x")  # partial downloads are never listed
    m = mm.build_manifest(tmp_path / "m", workers=3, bufsize=1 << 20)
    assert [f["path"] for f in m["files"]] == sorted(data)
    for f in m["files"]:
        assert f["size"] == len(data[f["path"]])
        assert f["sha256"] == hashlib.sha256(data[f["path"]]).hexdigest()
    listing = "".join(f"{p}\t{len(data[p])}\t{hashlib.sha256(data[p]).hexdigest()}\n" for p in sorted(data))
    assert m["revision"] == hashlib.sha256(listing.encode()).hexdigest()
    mm.validate_manifest(m, expected_revision=m["revision"])


@pytest.mark.parametrize("field,value", [("size", 1), ("sha256", "0" * 64), ("path", "renamed.json")])
def test_content_revision_detects_any_change(tmp_path, field, value):
    make_model(tmp_path / "m")
    m = mm.build_manifest(tmp_path / "m")
    entry = next(f for f in m["files"] if f["path"] == "config.json")
    entry[field] = value
    with pytest.raises(ManifestError, match="revision mismatch.*hashes to"):
        mm.validate_manifest(m)


def test_requested_revision_must_match(tmp_path):
    make_model(tmp_path / "m")
    m = mm.build_manifest(tmp_path / "m")
    msg = f"revision mismatch: src has revision {m['revision']} but abc was requested"
    with pytest.raises(ManifestError, match=msg):
        mm.validate_manifest(m, expected_revision="abc", origin="src")


@pytest.mark.parametrize(
    "files,err",
    [
        ([{"path": "../etc/passwd", "size": 1, "sha256": "a" * 64}], r"'\.\.'"),
        ([{"path": "/abs", "size": 1, "sha256": "a" * 64}], "relative"),
        ([{"path": "a", "size": 1, "sha256": "a" * 64}, {"path": "a", "size": 1, "sha256": "a" * 64}], "duplicate"),
        ([{"path": "a", "size": -1, "sha256": "a" * 64}], "invalid size"),
        ([{"path": "a", "size": 1, "sha256": "xyz"}], "invalid sha256"),
        ([{"path": "a", "size": 1, "sha256": "a" * 64}, {"path": "a/b", "size": 1, "sha256": "a" * 64}], "both a file"),
        ([{"path": "x.part", "size": 1, "sha256": "a" * 64}], "reserved"),
        ([], "non-empty"),
    ],
)
def test_validate_rejects_bad_manifests(files, err):
    with pytest.raises(ManifestError, match=err):
        mm.validate_manifest({"revision": "r1", "files": files})


# ------------------------------------------------------------------ verification


def test_verify_reports_each_state(tmp_path):
    d = tmp_path / "m"
    make_model(d)
    m = mm.build_manifest(d)
    shard = d / "model-00001-of-00002.safetensors"
    with open(shard, "r+b") as f:  # same size, one byte flipped in the middle
        f.seek(1_500_000)
        b = f.read(1)
        f.seek(1_500_000)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(d / "model-00002-of-00002.safetensors", "ab") as f:
        f.write(b"!")
    os.unlink(d / "config.json")
    states = mm.verify_files(d, m["files"], workers=4, bufsize=1 << 20)
    assert states == {
        "model-00001-of-00002.safetensors": mm.CHECKSUM_MISMATCH,
        "model-00002-of-00002.safetensors": mm.SIZE_MISMATCH,
        "config.json": mm.MISSING,
        "tokenizer/tokenizer.json": mm.OK,
    }
    # size-only mode cannot see the flipped byte, by design
    shallow = mm.verify_files(d, m["files"], deep=False)
    assert shallow["model-00001-of-00002.safetensors"] == mm.OK


def test_verify_hashes_in_parallel_threads(tmp_path, monkeypatch):
    d = tmp_path / "m"
    make_model(d, {f"s{i}.bin": 256 * 1024 for i in range(8)})
    m = mm.build_manifest(d)
    seen = set()
    barrier = threading.Barrier(4, timeout=10)
    real = mm.hash_file

    def spy(path, bufsize=DEFAULT_BUFSIZE, algo="sha256"):
        seen.add(threading.get_ident())
        barrier.wait()  # only passes if 4 hashes run at the same time
        return real(path, bufsize, algo)

    monkeypatch.setattr(mm, "hash_file", spy)
    states = mm.verify_files(d, m["files"], workers=4)
    assert set(states.values()) == {mm.OK}
    assert len(seen) == 4


def test_free_bytes_walks_up_to_existing_parent(tmp_path):
    path, free = free_bytes(tmp_path / "not" / "yet" / "there")
    assert path == str(tmp_path)
    st = os.statvfs(tmp_path)
    assert free == st.f_bavail * st.f_frsize


# ------------------------------------------------------------------ CLI


def test_cli_writes_manifest_revision_file_and_checks(tmp_path):
    d = tmp_path / "tiny-pd"
    make_model(d)
    rev_file = tmp_path / "tiny-pd.REVISION"
    out = subprocess.run([sys.executable, str(CLI), str(d), "--revision-file", str(rev_file)],
                         capture_output=True, text=True, check=True)
    m = json.loads((d / "manifest.json").read_text())
    assert out.stdout.strip() == m["revision"] == rev_file.read_text().strip()
    assert m["revision"] == mm.content_revision(m["files"])
    assert "manifest.json" not in [f["path"] for f in m["files"]]
    # re-running is stable (the manifest does not list itself)
    again = subprocess.run([sys.executable, str(CLI), str(d)], capture_output=True, text=True, check=True)
    assert again.stdout.strip() == m["revision"]
    ok = subprocess.run([sys.executable, str(CLI), "--check", str(d)], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    (d / "config.json").write_bytes(os.urandom(40))
    bad = subprocess.run([sys.executable, str(CLI), "--check", str(d)], capture_output=True, text=True, check=False)
    assert bad.returncode == 1
    assert "config.json: checksum_mismatch" in bad.stderr


def test_cli_explicit_revision(tmp_path):
    d = tmp_path / "m"
    make_model(d, {"a.bin": 10})
    out = subprocess.run([sys.executable, str(CLI), str(d), "--revision", "0123456789abcdef0123456789abcdef01234567"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0123456789abcdef0123456789abcdef01234567"
    assert json.loads((d / "manifest.json").read_text())["revision"] == out.stdout.strip()


# ------------------------------------------------------------------ fetchers resume by byte offset


def test_path_fetcher_resumes_from_offset(tmp_path):
    src = tmp_path / "src"
    data = make_model(src, {"big.safetensors": 5 * 1024 * 1024 + 3})["big.safetensors"]
    part = tmp_path / "big.safetensors.part"
    part.write_bytes(data[:2_000_000])
    entry = {"path": "big.safetensors", "size": len(data)}
    copied = PathFetcher(str(src), bufsize=1 << 20).fetch(entry, str(part))
    assert copied == len(data) - 2_000_000
    assert part.read_bytes() == data


def test_path_fetcher_discards_oversized_part(tmp_path):
    src = tmp_path / "src"
    data = make_model(src, {"a.bin": 1000})["a.bin"]
    part = tmp_path / "a.bin.part"
    part.write_bytes(b"x" * 2000)
    assert PathFetcher(str(src)).fetch({"path": "a.bin", "size": 1000}, str(part)) == 1000
    assert part.read_bytes() == data


@pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync not installed")
def test_rsync_fetcher_appends_only_missing_bytes(tmp_path):
    src = tmp_path / "peer"
    data = make_model(src, {"big.safetensors": 4 * 1024 * 1024})["big.safetensors"]
    (src / "manifest.json").write_text(json.dumps({"revision": "r", "files": []}))
    part = tmp_path / "dst" / "big.safetensors.part"
    part.parent.mkdir()
    part.write_bytes(data[:1_000_000])
    f = RsyncFetcher(real_run_command, str(src))
    sent = f.fetch({"path": "big.safetensors", "size": len(data)}, str(part))
    assert part.read_bytes() == data
    assert sent == len(data) - 1_000_000  # rsync --stats "Literal data": the first MB was not sent again
    assert f.manifest(str(tmp_path))["revision"] == "r"


def test_rsync_fetcher_builds_ssh_command():
    calls = []

    def fake(argv):
        calls.append(argv)
        return 0, "Literal data: 1,234 bytes\n", ""

    f = RsyncFetcher(fake, "/mnt/model/glm/revisions/abc", host="10.0.0.11", user="root", port=2222,
                     ssh_key="/root/.ssh/model_peer", ssh_args=["-o", "ConnectTimeout=5"])
    assert f.fetch({"path": "a/b.bin", "size": 10}, "/nonexistent/b.bin.part") == 1234
    argv = calls[0]
    assert argv[-2:] == ["root@10.0.0.11:/mnt/model/glm/revisions/abc/a/b.bin", "/nonexistent/b.bin.part"]
    assert "--append" in argv
    ssh = argv[argv.index("-e") + 1]
    assert ssh.startswith("ssh -o BatchMode=yes") and "-p 2222" in ssh and "-i /root/.ssh/model_peer" in ssh


def test_rsync_failure_is_reported():
    f = RsyncFetcher(lambda argv: (255, "", "ssh: connect to host 10.0.0.11 port 22: No route to host"),
                     "/r", host="10.0.0.11")
    with pytest.raises(ManifestError, match="rsync of a.bin from 10.0.0.11:/r failed .*No route to host"):
        f.fetch({"path": "a.bin", "size": 1}, "/nonexistent.part")


# ------------------------------------------------------------------ bench/verify_throughput.py


def test_bench_small_dataset_reports_and_detects_corruption(tmp_path):
    bench = ROOT / "bench" / "verify_throughput.py"
    d = tmp_path / "ds"
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(bench), "--size", "8M", "--files", "4", "--dir", str(d), "--workers", "2",
                        "--bufsize-mib", "1", "--cache-drop", "fadvise", "--json-out", str(out)],
                       capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["dataset"]["bytes"] == 8 * 1024 * 1024 and r["dataset"]["created"] is True
    assert r["verifier"]["all_ok"] is True
    assert r["verifier"]["GBps"] > 0 and r["disk_read_1_stream"]["GBps"] > 0
    assert r["ratio_verifier_to_disk"] == round(
        r["verifier"]["GBps"] / max(r["disk_read_1_stream"]["GBps"], r["disk_read_parallel"]["GBps"]), 3)
    m = json.loads((d / "manifest.json").read_text())
    assert m["revision"] == mm.content_revision(m["files"])
    assert mm.build_manifest(d)["files"] == m["files"]  # the on-the-fly hashes are the real ones
    # reuse the dataset, with one shard corrupted: the verifier must say so and the bench must fail
    shard = d / m["files"][0]["path"]
    with open(shard, "r+b") as f:
        f.write(b"\0" * 16)
    p = subprocess.run([sys.executable, str(bench), "--size", "8M", "--files", "4", "--dir", str(d),
                        "--bufsize-mib", "1", "--cache-drop", "fadvise", "--json-out", str(out)],
                       capture_output=True, text=True, check=False)
    r = json.loads(out.read_text())
    assert p.returncode == 1
    assert r["dataset"]["created"] is False
    assert r["verifier"]["bad"] == {m["files"][0]["path"]: "checksum_mismatch"}
