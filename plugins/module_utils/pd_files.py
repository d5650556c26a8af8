# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Atomic file writes for the bundle's modules (vllm_instance's units, env files, records and rollback copies;
the flag-parse cache): a reader sees the old content or the new, never a torn file, and mode and owner are set
before the rename so the file never exists with wrong permissions. model_manifest.write_atomic stays separate:
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
