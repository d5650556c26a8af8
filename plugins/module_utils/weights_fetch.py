# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Fetching the files a revision lacks: each into .staging/<revision>/<path>.part (resumed by byte offset),
verified against its manifest entry, and only then renamed into the revision directory, several files at a time.

Stdlib only: runs on the managed hosts."""

import os
import posixpath
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor

from ansible_collections.b300.pd.plugins.module_utils.model_errors import ManifestError, WeightsError
from ansible_collections.b300.pd.plugins.module_utils.model_hashing import hash_stream
from ansible_collections.b300.pd.plugins.module_utils.model_manifest import PART_SUFFIX
from ansible_collections.b300.pd.plugins.module_utils.model_nofollow import fd_path, open_nofollow


def fetch_all(store, fetcher, todo, download_workers, bufsize, *, authority="the manifest"):
    """Fetch the todo entries into store's revision directory, download_workers at a time; returns the bytes
    transferred. Each entry gets the sha256 it was checked against. Any failure is one WeightsError naming every
    file that failed; what arrived stays staged for the next run."""
    os.close(store.tree_dir(f".staging/{store.revision}"))
    transferred = 0
    errors = []
    with ThreadPoolExecutor(max_workers=download_workers) as ex:
        futures = [(f, ex.submit(fetch_one, store, fetcher, f, bufsize, authority)) for f in todo]
        for f, fut in futures:
            try:
                transferred += fut.result()
            except (ManifestError, WeightsError, OSError) as e:
                errors.append(f"{f['path']}: {e}")
    if errors:
        raise WeightsError(
            f"{len(errors)} of {len(todo)} files could not be fetched (what arrived is kept in "
            f"{store.staging} and resumed next run): " + "; ".join(errors)
        )
    return transferred


def fetch_one(store, fetcher, entry, bufsize, authority="the manifest"):
    """Fetch one entry into its .part, check it (once more from byte 0 if it is wrong), rename it into place."""
    rel_dir, name = posixpath.split(entry["path"])
    part_name = name + PART_SUFFIX
    stage_fd = store.tree_dir(posixpath.join(".staging", store.revision, rel_dir))
    try:
        part = (fd_path(stage_fd, part_name) if store.proc_fds
                else os.path.join(store.staging, entry["path"] + PART_SUFFIX))
        transferred = 0
        for attempt in (1, 2):
            transferred += fetcher.fetch(entry, part)
            good, size, sha256 = check_part(store, stage_fd, part_name, entry, bufsize)
            if good:
                break
            # A wrong prefix (earlier corrupt partial) or a bad transfer: start over from byte 0, once.
            try:
                os.unlink(part_name, dir_fd=stage_fd)
            except FileNotFoundError:
                pass
            if attempt == 2:
                raise WeightsError(refusal(fetcher, entry, size, sha256, authority))
        entry["sha256"] = sha256
        rev_fd = store.tree_dir(posixpath.join("revisions", store.revision, rel_dir))
        try:
            try:
                st = os.lstat(name, dir_fd=rev_fd)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISDIR(st.st_mode):
                shutil.rmtree(fd_path(rev_fd, name) if store.proc_fds else os.path.join(store.revdir, entry["path"]))
            # atomic, and relative to fds opened without following links: readers see the old file or the
            # verified new one, and the new one lands in the revision directory, nowhere else
            os.replace(part_name, name, src_dir_fd=stage_fd, dst_dir_fd=rev_fd)
        finally:
            os.close(rev_fd)
    finally:
        os.close(stage_fd)
    return transferred


def refusal(fetcher, entry, size, sha256, authority):
    """Why a file the source delivered twice is refused: the source (a peer names its host) and the file, what it
    sent and what authority (the manifest, or the one pinned on the control node) says."""
    want = entry.get("sha256") or f"git blob {entry.get('git_sha1')}"
    if size < 0:
        got = "nothing arrived"
    elif size != entry["size"]:
        got = f"size {size}, {authority} says {entry['size']}"
    else:
        got = f"sha256 {sha256}, {authority} says {want}"
    return (f"refused {entry['path']} from {fetcher.describe()}: it does not match {authority} after a full re-fetch "
            f"({got}); that source's copy was changed or is corrupt: repair it there (rerun the role on that host) "
            "or fetch from another source")


def check_part(store, stage_fd, part_name, entry, bufsize):
    """(good, size, sha256) of the staged .part, read through an O_NOFOLLOW fd; a good one is made 0644 and
    owned as configured through the same fd."""
    try:
        fd = open_nofollow(part_name, os.O_RDONLY, dir_fd=stage_fd)
    except FileNotFoundError:
        return False, -1, None
    with os.fdopen(fd, "rb", buffering=0) as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry["size"]:
            return False, st.st_size, None
        algos = ("sha256",) if "sha256" in entry else ("sha256", "git_sha1")
        _size, digests = hash_stream(fh, bufsize, algos, git_size=st.st_size)
        good = digests[0] == entry["sha256"] if "sha256" in entry else digests[1] == entry["git_sha1"]
        if good:
            os.fchmod(fd, 0o644)
            store.own_fd(fd)
        return good, st.st_size, digests[0]
