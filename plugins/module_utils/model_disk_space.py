# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Free disk space where a model will be written, measured before its directory exists, and byte counts for
messages. model_weights' disk preflight uses it; gpu_facts' disk check measures the same way.

Stdlib only: runs on the managed hosts and on the control node."""

import os


def statvfs_nearest(path):
    """(checked path, os.statvfs of it): path's nearest existing parent (itself when it exists), since the model root
    may not exist yet but its filesystem is what it will be written to."""
    checked = os.path.abspath(path)
    while not os.path.exists(checked):
        parent = os.path.dirname(checked)
        if parent == checked:
            break
        checked = parent
    return checked, os.statvfs(checked)


def free_bytes(path):
    """Free bytes for an unprivileged writer on the filesystem holding path (or its nearest existing parent)."""
    checked, st = statvfs_nearest(path)
    return checked, st.f_bavail * st.f_frsize


def human_bytes(n):
    """A byte count as B, KiB, MiB, GiB or TiB with one decimal (whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024.0
    return str(n)
