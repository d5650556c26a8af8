# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Hashing model files fast: sha256 (and the git blob id the hub reports for non-LFS files) read in large
unbuffered buffers, and the default number of hashing threads.

Stdlib only: runs on the managed hosts and on the control node."""

import hashlib
import os

DEFAULT_BUFSIZE = 16 * 1024 * 1024


def default_workers():
    """Hashing threads: one per CPU up to 16 (sha256 runs ~1-2 GB/s per core with SHA extensions)."""
    return max(1, min(16, os.cpu_count() or 1))


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
