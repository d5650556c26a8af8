# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""File writes for the bundle's modules (vllm_instance's units, env files, records and rollback copies; the
flag-parse cache). atomic_write: a reader sees the old content or the new, never a torn file, and mode and owner are
set before the rename so the file never exists with wrong permissions. model_manifest.write_atomic stays separate:
it writes inside a directory fd without following symlinks (weights staged from an untrusted source)."""

from __future__ import annotations

import os
import tempfile


def atomic_write(path, content, mode, uid=None, gid=None):
    """Write text to path via a temporary file in the same directory, fsync, then rename over it."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(content)
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            if uid is not None or gid is not None:
                os.fchown(fh.fileno(), -1 if uid is None else uid, -1 if gid is None else gid)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_text(path):
    """The file's text, or None when there is no file."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def file_needs_attrs(path, mode, uid, gid):
    """True when the file is missing or its mode, owner (uid) or group (gid) differ; None: that one is not managed."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return True
    if (st.st_mode & 0o7777) != mode:
        return True
    if uid is not None and st.st_uid != uid:
        return True
    return gid is not None and st.st_gid != gid


def set_attrs(path, mode, uid, gid):
    os.chmod(path, mode)
    if uid is not None or gid is not None:
        os.chown(path, -1 if uid is None else uid, -1 if gid is None else gid)
