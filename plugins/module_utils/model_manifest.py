# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The model manifest: its format and revision, building, validating, reading and writing it, comparing two, and
verifying a directory against it. Shared by the model_weights module, scripts/model-manifest and
bench/verify_throughput.py.

Manifest (JSON):  {"revision": "<id>", "files": [{"path": "...", "size": N, "sha256": "..."}]}
A locally generated model's revision is content_revision(files): the sha256 of the canonical file list,
one line per file sorted by path, "<path>\t<size>\t<sha256>\n" (UTF-8). A 64-hex revision is therefore
checkable against the file list; a 40-hex revision is a Hugging Face commit id and is checked against the hub.

Stdlib only: runs on the managed hosts (as ansible_collections.b300.pd.plugins.module_utils.model_manifest)
and on the control node."""

import errno
import hashlib
import json
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor

from ansible_collections.b300.pd.plugins.module_utils.model_errors import ManifestError
from ansible_collections.b300.pd.plugins.module_utils.model_hashing import (
    DEFAULT_BUFSIZE,
    default_workers,
    git_blob_sha1,
    hash_file,
)
from ansible_collections.b300.pd.plugins.module_utils.model_nofollow import fd_path, open_nofollow

MANIFEST_NAME = "manifest.json"
PART_SUFFIX = ".part"
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
SHA1_RE = re.compile(r"^[0-9a-f]{40}$")

# Per-file states reported by verification and by the module.
OK = "ok"
MISSING = "missing"
SIZE_MISMATCH = "size_mismatch"
CHECKSUM_MISMATCH = "checksum_mismatch"
REPAIRED = "repaired"
FETCHED = "fetched"


# ---------------------------------------------------------------- manifests


def canonical_listing(files):
    rows = sorted(files, key=lambda x: x["path"])
    return "".join(f"{f['path']}\t{f['size']}\t{f['sha256']}\n" for f in rows)


def content_revision(files):
    """sha256 of the canonical file list: the revision id of a locally generated model."""
    return hashlib.sha256(canonical_listing(files).encode("utf-8")).hexdigest()


def _check_relpath(p):
    if not isinstance(p, str) or not p:
        raise ManifestError(f"manifest file entry has an empty or non-string path: {p!r}")
    if p.startswith("/") or "\\" in p or "\0" in p:
        raise ManifestError(f"manifest path {p!r} must be relative, with '/' separators")
    parts = p.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ManifestError(f"manifest path {p!r} has an empty, '.' or '..' component")
    if p == MANIFEST_NAME:
        raise ManifestError(f"manifest lists itself ({MANIFEST_NAME})")
    if p.endswith(PART_SUFFIX):
        raise ManifestError(f"manifest path {p!r} ends in {PART_SUFFIX}, reserved for partial downloads")


def validate_manifest(manifest, expected_revision=None, origin="manifest"):
    """Check structure, paths and (for 64-hex revisions) that the revision matches the file list.

    Entries may carry "git_sha1" instead of "sha256" only in manifests built from the hub (non-LFS files);
    those are turned into sha256 entries once the file is fetched and checked.
    """
    if not isinstance(manifest, dict):
        raise ManifestError(f"{origin}: not a JSON object")
    rev = manifest.get("revision")
    files = manifest.get("files")
    if not isinstance(rev, str) or not rev:
        raise ManifestError(f"{origin}: missing 'revision'")
    if not isinstance(files, list) or not files:
        raise ManifestError(f"{origin}: 'files' must be a non-empty list")
    seen = set()
    for f in files:
        if not isinstance(f, dict):
            raise ManifestError(f"{origin}: file entry {f!r} is not an object")
        _check_relpath(f.get("path"))
        if f["path"] in seen:
            raise ManifestError("{}: duplicate path {}".format(origin, f["path"]))
        seen.add(f["path"])
        size = f.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError("{}: {} has an invalid size {!r}".format(origin, f["path"], size))
        sha = f.get("sha256")
        if sha is None and SHA1_RE.match(str(f.get("git_sha1", ""))):
            continue
        if not isinstance(sha, str) or not SHA256_RE.match(sha):
            raise ManifestError("{}: {} has an invalid sha256 {!r}".format(origin, f["path"], sha))
    # A directory and a file of the same name cannot both exist.
    for p in seen:
        parts = p.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in seen:
                raise ManifestError("{}: {} is both a file and a directory".format(origin, "/".join(parts[:i])))
    if expected_revision is not None and rev != expected_revision:
        raise ManifestError(
            f"revision mismatch: {origin} has revision {rev} but {expected_revision} was requested; "
            "pin the revision the source really holds (pd_model_source.revision) or fix the source"
        )
    if SHA256_RE.match(rev) and all("sha256" in f for f in files):
        actual = content_revision(files)
        if actual != rev:
            raise ManifestError(
                f"revision mismatch: {origin} claims revision {rev} but its file list hashes to {actual} "
                "(manifest edited or files changed after it was written; regenerate it with scripts/model-manifest)"
            )
    return manifest


def list_files(directory):
    """Relative paths of the regular files under directory (symlinks to files followed), manifest excluded."""
    out = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".staging"))
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, directory).replace(os.sep, "/")
            if rel == MANIFEST_NAME or rel.endswith(PART_SUFFIX):
                continue
            if not stat.S_ISREG(os.stat(full).st_mode):
                continue
            out.append(rel)
    return sorted(out)


def build_manifest(directory, revision=None, workers=None, bufsize=DEFAULT_BUFSIZE):
    paths = list_files(directory)
    if not paths:
        raise ManifestError(f"{directory} holds no files")
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as ex:
        results = list(ex.map(lambda p: hash_file(os.path.join(directory, p), bufsize), paths))
    files = [{"path": p, "size": s, "sha256": h} for p, (s, h) in zip(paths, results, strict=True)]
    return {"revision": revision or content_revision(files), "files": files}


def dumps_manifest(manifest):
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def write_atomic(path, data, mode=0o644, dir_fd=None):
    """Write data to path through a temporary file and a rename. The temporary name is predictable, so a stale one
    (or a symlink planted there) is unlinked and the file made with O_EXCL|O_NOFOLLOW: nothing is written through a
    link. With dir_fd, path is a name in that directory. Any OSError (ENOSPC above all) is a ManifestError naming
    the path; the temporary file is removed."""
    shown = path if dir_fd is None else fd_path(dir_fd, path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
                f.flush()
                os.fchmod(f.fileno(), mode)
                os.fsync(f.fileno())
        except BaseException:
            os.unlink(tmp, dir_fd=dir_fd)
            raise
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as e:
        hint = "the filesystem is full: free space there (or lower model_weights_keep) and rerun" if (
            e.errno == errno.ENOSPC) else "check the directory's permissions and filesystem"
        raise ManifestError(f"cannot write {shown}: {e.strerror or e}; {hint}") from None


def read_manifest_file(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ManifestError(f"{path} does not exist") from None
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path} is not readable JSON: {e}") from None


def manifest_differences(local, source):
    """What differs between two manifests of one revision (by path: missing, extra, size, sha256 where both have
    it); [] when they agree. The hub gives only a git blob id for non-LFS files: no sha256 to compare there."""
    a = {f["path"]: f for f in local["files"]}
    b = {f["path"]: f for f in source["files"]}
    out = [f"{p} is missing from it" for p in sorted(set(b) - set(a))]
    out += [f"{p} is listed but not in the source" for p in sorted(set(a) - set(b))]
    for p in sorted(set(a) & set(b)):
        if a[p]["size"] != b[p]["size"]:
            out.append(f"{p} has size {a[p]['size']}, the source {b[p]['size']}")
        elif "sha256" in a[p] and "sha256" in b[p] and a[p]["sha256"] != b[p]["sha256"]:
            out.append(f"{p} has sha256 {a[p]['sha256'][:12]}..., the source {b[p]['sha256'][:12]}...")
    return out


# ---------------------------------------------------------------- verification


def verify_files(directory, files, workers=None, bufsize=DEFAULT_BUFSIZE, deep=True):
    """State of each manifest entry in directory: sizes first (cheap), then sha256 of the survivors in parallel.

    Returns {path: state}. With deep=False only sizes are checked (ok means "right size").
    """
    states = {}
    to_hash = []
    for f in files:
        full = os.path.join(directory, f["path"])
        try:
            st = os.lstat(full)  # a symlink is not the file, whatever it points to
        except FileNotFoundError:
            states[f["path"]] = MISSING
            continue
        if not stat.S_ISREG(st.st_mode):
            states[f["path"]] = MISSING
        elif st.st_size != f["size"]:
            states[f["path"]] = SIZE_MISMATCH
        else:
            states[f["path"]] = OK
            to_hash.append(f)
    if deep and to_hash:
        # Biggest first so one large shard does not end up alone at the tail.
        to_hash.sort(key=lambda f: -f["size"])
        with ThreadPoolExecutor(max_workers=workers or default_workers()) as ex:
            digests = list(ex.map(lambda f: _digest_for(os.path.join(directory, f["path"]), f, bufsize), to_hash))
        for f, good in zip(to_hash, digests, strict=True):
            if not good:
                states[f["path"]] = CHECKSUM_MISMATCH
    return states


def _digest_for(full, entry, bufsize):
    if "sha256" in entry:
        return hash_file(full, bufsize)[1] == entry["sha256"]
    return git_blob_sha1(full, bufsize) == entry["git_sha1"]
