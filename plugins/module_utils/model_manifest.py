# Shared logic of the model_weights module, scripts/model-manifest and bench/verify_throughput.py.
#
# Manifest (JSON):  {"revision": "<id>", "files": [{"path": "...", "size": N, "sha256": "..."}]}
# A locally generated model's revision is content_revision(files): the sha256 of the canonical file list,
# one line per file sorted by path, "<path>\t<size>\t<sha256>\n" (UTF-8). A 64-hex revision is therefore
# checkable against the file list; a 40-hex revision is a Hugging Face commit id and is checked against the hub.
#
# Stdlib only: runs on the managed hosts (as ansible_collections.b300.pd.plugins.module_utils.model_manifest)
# and on the control node.

import errno
import glob
import hashlib
import http.client
import json
import os
import re
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

MANIFEST_NAME = "manifest.json"
PART_SUFFIX = ".part"
DEFAULT_BUFSIZE = 16 * 1024 * 1024
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
SHA1_RE = re.compile(r"^[0-9a-f]{40}$")

# Per-file states reported by verification and by the module.
OK = "ok"
MISSING = "missing"
SIZE_MISMATCH = "size_mismatch"
CHECKSUM_MISMATCH = "checksum_mismatch"
REPAIRED = "repaired"
FETCHED = "fetched"


class ManifestError(Exception):
    """Bad manifest, revision mismatch or a source that cannot deliver a file."""


class UnsafePathError(ManifestError):
    """A symlink (or a non-directory) where model_weights expects a directory or file of its own tree."""


# ---------------------------------------------------------------- never following links in our own trees
#
# The module runs as root and its trees (revisions/<rev>/, .staging/<rev>/) may be writable by model_weights_owner.
# A symlink planted there must never be followed: every directory below the root is opened with O_NOFOLLOW relative
# to its parent's fd, files are opened with O_NOFOLLOW, and renames/unlinks are dir_fd-relative.

_DIR_NOFOLLOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def symlink_error(path):
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return UnsafePathError(
        f"{path} is a symlink (to {target}); model_weights never follows links inside its root (run as root, a "
        f"planted link would make it write outside the root): check who made it, remove it (rm {path}) and rerun"
    )


def _unsafe(path, err):
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            return symlink_error(path)
    except OSError:
        pass
    if err.errno == errno.ENOTDIR:
        return UnsafePathError(f"{path} is not a directory; model_weights keeps its own directory there: move it away")
    return None


def open_dir_beneath(root, rel, create=False, mode=0o755, on_create=None):
    """An fd of directory root/rel; each component below root opened with O_NOFOLLOW (a symlink is an
    UnsafePathError, never followed). Missing components are made (mode, then on_create(fd)) when create.
    root itself is the operator's path and may be a symlink (a mount point moved elsewhere)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    path = root
    try:
        for name in [c for c in rel.split("/") if c]:
            path = os.path.join(path, name)
            made = False
            try:
                try:
                    nfd = os.open(name, _DIR_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(name, mode, dir_fd=fd)
                        made = True
                    except FileExistsError:
                        pass
                    nfd = os.open(name, _DIR_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                bad = _unsafe(path, e) if e.errno in (errno.ELOOP, errno.ENOTDIR) else None
                if bad:
                    raise bad from None
                raise
            os.close(fd)
            fd = nfd
            if made:
                os.fchmod(fd, mode)  # umask-independent
                if on_create:
                    on_create(fd)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_nofollow(path, flags, mode=0o644, dir_fd=None):
    """os.open that refuses a symlink as the last component with a named UnsafePathError."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            full = path if dir_fd is None else fd_path(dir_fd, path)
            raise symlink_error(full) from None
        raise


def fd_path(dir_fd, name=""):
    """A path to name inside the directory open as dir_fd, resolved through the fd (not through the names that led
    to it, which someone could swap for a symlink meanwhile). /proc/<pid>/ rather than /proc/self/ so a child
    (rsync) resolves it through this process's fd too."""
    base = f"/proc/{os.getpid()}/fd/{dir_fd}"
    return f"{base}/{name}" if name else base


def scan_links(directory):
    """Paths (relative, sorted) of the symlinks anywhere under directory (directory itself excluded), not followed."""
    out = []
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=False):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                out.append(os.path.relpath(full, directory).replace(os.sep, "/"))
    return sorted(out)


def default_workers():
    """Hashing threads: one per CPU up to 16 (sha256 runs ~1-2 GB/s per core with SHA extensions)."""
    return max(1, min(16, os.cpu_count() or 1))


# ---------------------------------------------------------------- hashing


def hash_file(path, bufsize=DEFAULT_BUFSIZE, algo="sha256"):
    """Return (size, hexdigest) of a file, read in large buffers (hashlib releases the GIL on big updates)."""
    with open(path, "rb", buffering=0) as f:
        size, digests = hash_stream(f, bufsize, (algo,))
    return size, digests[0]


def hash_stream(f, bufsize=DEFAULT_BUFSIZE, algos=("sha256",), git_size=None):
    """(size, [hexdigest per algo]) of an unbuffered binary file object from its current position.
    "git_sha1" is the git blob id, which needs the size up front (git_size)."""
    hashers = []
    for a in algos:
        if a == "git_sha1":
            h = hashlib.sha1(usedforsecurity=False)
            h.update(b"blob %d\0" % git_size)
        else:
            h = hashlib.new(a)
        hashers.append(h)
    size = 0
    buf = bytearray(bufsize)
    view = memoryview(buf)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger kernel readahead
    while True:
        n = f.readinto(buf)
        if not n:
            break
        for h in hashers:
            h.update(view[:n])
        size += n
    return size, [h.hexdigest() for h in hashers]


def git_blob_sha1(path, bufsize=DEFAULT_BUFSIZE):
    """The git blob id of a file (what the hub reports for files not stored in LFS)."""
    size = os.path.getsize(path)
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"blob %d\0" % size)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(bufsize), b""):
            h.update(chunk)
    return h.hexdigest()


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


def free_bytes(path):
    """Free bytes for an unprivileged writer on the filesystem holding path (or its nearest existing parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    st = os.statvfs(p)
    return p, st.f_bavail * st.f_frsize


# ---------------------------------------------------------------- fetchers
#
# Every fetcher appends to an existing <dest>.part from its current length (resume by byte offset) and
# returns the number of bytes it transferred. The caller verifies the .part before moving it into place.


def _part_offset(part, size):
    try:
        st = os.lstat(part)
    except FileNotFoundError:
        return 0
    if stat.S_ISLNK(st.st_mode):
        raise symlink_error(part)
    have = st.st_size
    if have > size:
        os.unlink(part)
        return 0
    return have


class PathFetcher:
    """A directory (shared storage, bind mount) that holds the files and manifest.json."""

    kind = "path"

    def __init__(self, path, bufsize=DEFAULT_BUFSIZE):
        self.path = path
        self.bufsize = bufsize

    def describe(self):
        return self.path

    def manifest(self):
        return read_manifest_file(os.path.join(self.path, MANIFEST_NAME))

    def fetch(self, entry, part):
        src = os.path.join(self.path, entry["path"])
        offset = _part_offset(part, entry["size"])
        copied = 0
        try:
            fin = open(src, "rb")
        except OSError as e:
            raise ManifestError("cannot read {} from source {}: {}".format(entry["path"], self.path, e)) from None
        with fin, os.fdopen(open_nofollow(part, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab") as fout:
            fin.seek(offset)
            while offset + copied < entry["size"]:
                chunk = fin.read(min(self.bufsize, entry["size"] - offset - copied))
                if not chunk:
                    break
                fout.write(chunk)
                copied += len(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        return copied


class RedirectRefused(urllib.error.URLError):
    """A redirect from https to http: refused, see _SafeRedirect."""


class _SafeRedirect(urllib.request.HTTPRedirectHandler):
    """Keep Range on redirects; drop Authorization when the redirect leaves the original host or port (hub -> CDN);
    refuse any redirect from https to http.

    Refused, not just stripped of Authorization: over http the bearer token would travel in clear text, and even
    without it the hub's metadata (file list, sizes, sha256 - what every downloaded byte is checked against) would
    then be open to tampering; a private repository would only fail later with a misleading 401 from the http URL.
    A hub or mirror that downgrades is misconfigured or intercepted, and the error says so.
    """

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: PLR0917 (stdlib signature)
        old = urllib.parse.urlsplit(req.full_url)
        new_parts = urllib.parse.urlsplit(urllib.parse.urljoin(req.full_url, newurl))
        if old.scheme == "https" and new_parts.scheme != "https":
            raise RedirectRefused(
                f"refused the redirect from {req.full_url} to {newurl} (HTTP {code}): it leaves https, so the token "
                "and the file metadata would travel unprotected; fix the endpoint/mirror so it stays on https"
            )
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            if new_parts.netloc != old.netloc or new_parts.scheme != old.scheme:
                new.remove_header("Authorization")
            rng = req.get_header("Range")
            if rng and not new.has_header("Range"):
                new.add_header("Range", rng)
        return new


class HttpFetcher:
    """A mirror base URL serving <base>/<path> for each file and <base>/manifest.json."""

    kind = "http"

    def __init__(self, base_url, token=None, timeout=60, bufsize=DEFAULT_BUFSIZE, retries=3):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.bufsize = bufsize
        self.retries = retries
        self.opener = urllib.request.build_opener(_SafeRedirect())

    def describe(self):
        return self.base_url

    def _request(self, url, headers=None):
        req = urllib.request.Request(url, headers=dict(headers or {}))
        req.add_header("User-Agent", "b300-pd-model-weights/1")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        return self.opener.open(req, timeout=self.timeout)

    def _get_json(self, url):
        try:
            with self._request(url) as r:
                return json.loads(r.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            raise ManifestError(f"GET {url}: HTTP {e.code} {e.reason}") from None
        except RedirectRefused as e:
            raise ManifestError(f"GET {url}: {e.reason}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ManifestError(f"GET {url}: {e}") from None

    def manifest(self):
        return self._get_json(f"{self.base_url}/{MANIFEST_NAME}")

    def file_url(self, path):
        return f"{self.base_url}/{urllib.parse.quote(path)}"

    def fetch(self, entry, part):
        moved = [0]  # bytes written to the .part by every attempt, including ones cut off midway
        last = None
        for attempt in range(self.retries + 1):
            try:
                self._fetch_once(entry, part, moved)
                return moved[0]
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                # Connection dropped mid-body: what arrived is on disk; the next attempt resumes from there.
                last = e
                if isinstance(e, RedirectRefused) or (
                    isinstance(e, urllib.error.HTTPError) and e.code < 500 and e.code != 429
                ):
                    break
                time.sleep(min(2**attempt, 10) if attempt < self.retries else 0)
        raise ManifestError("downloading {} from {} failed: {}".format(entry["path"], self.describe(), last))

    def _fetch_once(self, entry, part, moved):
        size = entry["size"]
        offset = _part_offset(part, size)
        if offset == size:
            return
        url = self.file_url(entry["path"])
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        copied = 0
        with self._request(url, headers) as r:
            status = getattr(r, "status", 200)
            if offset and status == 206:
                crange = r.headers.get("Content-Range", "")
                if not crange.startswith(f"bytes {offset}-"):
                    raise ManifestError(f"{url}: asked for bytes {offset}-, server sent Content-Range {crange!r}")
                mode = "ab"
            elif status == 200:
                mode = "wb"  # server ignored Range: start over
                offset = 0
            else:
                raise ManifestError(f"{url}: unexpected HTTP status {status}")
            flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "ab" else os.O_TRUNC)
            with os.fdopen(open_nofollow(part, flags), mode) as fout:
                while offset + copied < size:
                    chunk = r.read(min(self.bufsize, size - offset - copied))
                    if not chunk:
                        break
                    fout.write(chunk)
                    copied += len(chunk)
                    moved[0] += len(chunk)
                fout.flush()
                os.fsync(fout.fileno())
        if offset + copied < size:
            raise ConnectionError(f"{url}: connection closed after {offset + copied} of {size} bytes")


class HfFetcher(HttpFetcher):
    """The Hugging Face hub at a pinned commit: file list with LFS sha256 + sizes from the same REST endpoint
    huggingface_hub's HfApi.model_info(files_metadata=True) uses, downloads via /<repo>/resolve/<rev>/<file>."""

    kind = "hf"

    def __init__(self, repo_id, revision, endpoint="https://huggingface.co", **kw):
        super().__init__(endpoint, **kw)
        self.repo_id = repo_id
        self.revision = revision

    def describe(self):
        return f"{self.base_url}/{self.repo_id}@{self.revision}"

    def manifest(self):
        url = "{}/api/models/{}/revision/{}?blobs=true".format(
            self.base_url,
            self.repo_id,
            urllib.parse.quote(self.revision, safe=""),
        )
        info = self._get_json(url)
        return hub_manifest(info, self.repo_id, self.revision, url)

    def file_url(self, path):
        return f"{self.base_url}/{self.repo_id}/resolve/{self.revision}/{urllib.parse.quote(path)}"


def _hub_int(value, what, fix):
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ManifestError(f"{what} is {value!r}, not a byte count; {fix}")
    try:
        n = int(value)
    except ValueError:
        raise ManifestError(f"{what} is {value!r}, not a byte count; {fix}") from None
    if n < 0:
        raise ManifestError(f"{what} is negative ({n}); {fix}")
    return n


def hub_manifest(info, repo_id, revision, url):
    """The manifest of a hub commit from /api/models/<repo>/revision/<rev>?blobs=true; every malformed field is a
    ManifestError naming it (never a KeyError/TypeError out of the module)."""
    fix = (f"source.endpoint must be a Hugging Face hub API whose {url} returns siblings with sizes and lfs.sha256 "
           "(files_metadata); otherwise serve the revision from a mirror with a manifest.json (source.type=http)")
    where = f"hub metadata of {repo_id}@{revision}"
    if not isinstance(info, dict):
        raise ManifestError(f"{where} is a JSON {type(info).__name__}, not an object; {fix}")
    sha = info.get("sha")
    if sha != revision:
        raise ManifestError(
            f"revision mismatch: the hub resolves {repo_id}@{revision} to commit {sha}; pin the full 40-hex commit id"
        )
    siblings = info.get("siblings")
    if not isinstance(siblings, list):
        raise ManifestError(f"{where}: 'siblings' is a {type(siblings).__name__}, not a list of files; {fix}")
    files = []
    for i, s in enumerate(siblings):
        if not isinstance(s, dict):
            raise ManifestError(f"{where}: siblings[{i}] is {s!r}, not an object; {fix}")
        name = s.get("rfilename")
        if not isinstance(name, str) or not name:
            raise ManifestError(f"{where}: siblings[{i}].rfilename is {name!r}, not a file name; {fix}")
        if name in (".gitattributes", MANIFEST_NAME):
            continue
        lfs = s.get("lfs")
        if lfs:
            if not isinstance(lfs, dict):
                raise ManifestError(f"{where}: {name}: 'lfs' is {lfs!r}, not an object; {fix}")
            sha256 = lfs.get("sha256")
            if not isinstance(sha256, str) or not SHA256_RE.match(sha256):
                raise ManifestError(f"{where}: {name}: lfs.sha256 is {sha256!r}, not 64 hex digits; {fix}")
            size = _hub_int(lfs.get("size"), f"{where}: {name}: lfs.size", fix)
            files.append({"path": name, "size": size, "sha256": sha256})
        else:
            blob = s.get("blobId")
            if s.get("size") is None or not isinstance(blob, str) or not SHA1_RE.match(blob):
                raise ManifestError(
                    f"{where}: {name} has no lfs.sha256 and no size + 40-hex blobId (blobId {blob!r}, size "
                    f"{s.get('size')!r}); {fix}"
                )
            size = _hub_int(s["size"], f"{where}: {name}: size", fix)
            files.append({"path": name, "size": size, "git_sha1": blob})
    return {"revision": sha, "files": files}


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



# ---------------------------------------------------------------- revisions in use by vLLM instances
#
# plugins/modules/vllm_instance.py writes one record per instance (/etc/vllm/<name>.record.json, and the
# rollback target's under /etc/vllm/rollback/): JSON of schema 1 whose model_path is the revision directory the unit
# loads and whose
# model_revision is that directory's name (null when model_path is not under a "revisions" directory).

INSTANCE_RECORD_SCHEMA = 1


def _record_revisions(record, revisions_dir):
    """The revisions of revisions_dir that one parsed record names; raises ValueError when it cannot be told."""
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object")
    if record.get("schema") != INSTANCE_RECORD_SCHEMA:
        raise ValueError(f"schema {record.get('schema')!r}, this module reads schema {INSTANCE_RECORD_SCHEMA}")
    rev, path = record.get("model_revision"), record.get("model_path")
    if rev is not None and (not isinstance(rev, str) or not rev or "/" in rev):
        raise ValueError(f"model_revision {rev!r} is not a revision id")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"model_path {path!r} is not an absolute path")
    found = {rev} if rev else set()
    path = os.path.normpath(path)
    # realpath of the parent only: the revisions directory may sit behind a link (e.g. /srv/models -> /data/models),
    # but model_path itself must not be resolved (the served symlink now points elsewhere than what the unit loads).
    if os.path.realpath(os.path.dirname(path)) == os.path.realpath(revisions_dir):
        found.add(os.path.basename(path))
    return found


def revisions_in_use(patterns, revisions_dir):
    """Read the instance records matching the glob patterns: ({revision: [record paths]}, [problems]).

    A record that cannot be read or understood is a problem ("<path>: <why>"), never silently skipped: the caller
    must then assume any revision may be in use. A record that vanished between the glob and the read is gone (its
    instance was removed) and names nothing.
    """
    used = {}
    problems = []
    for path in sorted({p for pattern in patterns for p in glob.glob(pattern)}):
        try:
            with open(path, encoding="utf-8") as fh:
                record = json.load(fh)
            revisions = _record_revisions(record, revisions_dir)
        except FileNotFoundError:
            continue
        except OSError as e:
            problems.append(f"{path}: {e.strerror or e}")
            continue
        except json.JSONDecodeError as e:
            problems.append(f"{path}: not valid JSON ({e})")
            continue
        except UnicodeDecodeError:
            problems.append(f"{path}: not UTF-8 text")
            continue
        except ValueError as e:
            problems.append(f"{path}: {e}")
            continue
        for rev in revisions:
            used.setdefault(rev, []).append(path)
    return used, problems


class RsyncFetcher:
    """Another cluster host (or a local dir in tests) that already holds the revision directory.

    run_command(argv) -> (rc, stdout, stderr): the module passes module.run_command.
    """

    kind = "peer"

    def __init__(self, run_command, path, *, host=None, user=None, port=None, ssh_key=None, ssh_args=None):
        self.run_command = run_command
        self.path = path.rstrip("/")
        self.host = host or None
        self.user = user
        self.port = port
        self.ssh_key = ssh_key
        self.ssh_args = ssh_args or []

    def describe(self):
        return (f"{self._remote_host()}:{self.path}") if self.host else self.path

    def _remote_host(self):
        return f"{self.user}@{self.host}" if self.user else self.host

    def _src(self, rel):
        p = f"{self.path}/{rel}"
        return f"{self._remote_host()}:{p}" if self.host else p

    def _argv(self, extra):
        argv = ["rsync", "--stats", "--no-motd"]
        if self.host:
            ssh = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
            if self.port:
                ssh += ["-p", str(self.port)]
            if self.ssh_key:
                ssh += ["-i", self.ssh_key]
            ssh += list(self.ssh_args)
            argv += ["-e", " ".join(ssh)]
        return argv + extra

    def _run(self, argv, what):
        rc, out, err = self.run_command(argv)
        if rc != 0:
            raise ManifestError(f"rsync of {what} from {self.describe()} failed (rc={rc}): {(err or out).strip()}")
        return out

    def manifest(self, tmpdir):
        """Copy the peer's manifest.json into tmpdir (outside the model root: check mode may call this)."""
        dest = os.path.join(tmpdir, ".peer-" + MANIFEST_NAME)
        self._run(self._argv(["--", self._src(MANIFEST_NAME), dest]), MANIFEST_NAME)
        try:
            return read_manifest_file(dest)
        finally:
            os.unlink(dest)

    def fetch(self, entry, part):
        offset = _part_offset(part, entry["size"])
        # --append: continue the .part from its current length (rsync's resume by byte offset); the caller checks
        # the sha256 afterwards and restarts from zero if the prefix was bad.
        out = self._run(self._argv(["--append", "--", self._src(entry["path"]), part]), entry["path"])
        m = re.search(r"Literal data:\s*([\d,]+)", out)
        if m:
            return int(m.group(1).replace(",", ""))
        return max(0, os.lstat(part).st_size - offset)
