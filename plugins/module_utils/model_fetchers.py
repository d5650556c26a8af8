# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Where model_weights gets missing files from: a directory (PathFetcher), an HTTP mirror (HttpFetcher), the Hugging
Face hub at a pinned commit (HfFetcher, with the hub's file metadata turned into a manifest) and a peer over rsync
(RsyncFetcher).

Every fetcher appends to an existing <dest>.part from its current length (resume by byte offset) and returns the
number of bytes it transferred. The caller verifies the .part before moving it into place.

Stdlib only: runs on the managed hosts and on the control node."""

import http.client
import json
import os
import re
import stat
import time
import urllib.error
import urllib.parse
import urllib.request

from ansible_collections.b300.pd.plugins.module_utils.model_errors import ManifestError
from ansible_collections.b300.pd.plugins.module_utils.model_hashing import DEFAULT_BUFSIZE
from ansible_collections.b300.pd.plugins.module_utils.model_manifest import (
    MANIFEST_NAME,
    SHA1_RE,
    SHA256_RE,
    read_manifest_file,
)
from ansible_collections.b300.pd.plugins.module_utils.model_nofollow import open_nofollow, symlink_error


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


class RsyncFetcher:
    """Another cluster host (or a local dir in tests) that already holds the revision directory.

    run_command(argv) -> (rc, stdout, stderr): the module passes module.run_command.
    """

    kind = "peer"

    def __init__(self, run_command, path, *, host=None, user=None, port=None, ssh_key=None, ssh_args=None,
                 name=None):
        self.run_command = run_command
        self.path = path.rstrip("/")
        self.host = host or None
        self.user = user
        self.port = port
        self.ssh_key = ssh_key
        self.ssh_args = ssh_args or []
        self.name = name or None  # the peer's inventory name, for messages

    def describe(self):
        where = (f"{self._remote_host()}:{self.path}") if self.host else self.path
        return f"host {self.name} ({where})" if self.name else where

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
