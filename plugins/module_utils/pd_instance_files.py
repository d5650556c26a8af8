# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""vllm_instance's files on the host: the unit, env file and record it rendered, compared with what is on disk and
with what the process runs; the restart that a change owes (the pending marker); the previous state kept for a
rollback; and the writes.

The record and marker paths are plugins/module_utils/pd_record.py's, which pd_instance_state reads back.
"""

from __future__ import annotations

import grp
import os

from ansible_collections.b300.pd.plugins.module_utils.pd_files import (
    atomic_write,
    file_needs_attrs,
    read_text,
    set_attrs,
)
from ansible_collections.b300.pd.plugins.module_utils.pd_record import RECORD_SUFFIX


def under_root(render_root, path):
    """Where `path` of the host is written: itself, or below render_root for a review render."""
    if not render_root:
        return path
    return os.path.join(render_root, path.lstrip("/"))


def pinned_model_path(path):
    """The revision directory a served symlink points to, or None (not a symlink, or nothing there yet)."""
    if not isinstance(path, str) or not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    return target if os.path.isdir(target) else None


def owner_ids(module, name, group, render_root):
    """(uid, gid) the files get: root and `group` when run as root on the host; None for what is left as it is."""
    if render_root:
        return None, None
    gid = None
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        if not module.check_mode:
            module.fail_json(
                msg=f"instance {name}: group {group!r} does not exist; create it first "
                "(role vllm_serve does, in tasks/user.yml); nothing was written."
            )
    return (0 if os.geteuid() == 0 else None), gid


def rollback_files(rollback_dir, name, paths, group):
    """What save_rollback keeps and a rollback puts back: saved copy, live path, mode and group of each file."""
    unit_path, env_path, rec_path = paths
    return [
        dict(saved=os.path.join(rollback_dir, name + ".service"), dest=unit_path, mode="0644", group="root"),
        dict(saved=os.path.join(rollback_dir, name + ".env"), dest=env_path, mode="0640", group=group),
        dict(saved=os.path.join(rollback_dir, name + RECORD_SUFFIX), dest=rec_path, mode="0644", group="root"),
    ]


def save_rollback(files, before_texts, *, uid, gid):
    """Copy the files the instance runs now to their rollback copies (dir 0750 root), as rollback_files lists them."""
    rollback_dir = os.path.dirname(files[0]["saved"])
    if not os.path.isdir(rollback_dir):
        os.makedirs(rollback_dir, mode=0o750, exist_ok=True)
    for f in files:
        if before_texts.get(f["dest"]) is None:
            if os.path.exists(f["saved"]):  # no record before (a unit from an older bundle): no stale one either
                os.unlink(f["saved"])
            continue
        fgid = gid if f["group"] != "root" and uid == 0 else None
        atomic_write(f["saved"], before_texts[f["dest"]], int(f["mode"], 8), uid, fgid)


class InstanceFiles:
    """The files of one instance, [(path, text, mode, uid, gid)] with the unit first, against the host's disk.

    pending_path: the restart-pending marker (None for a review render); saved_files: rollback_files() (None too).
    """

    def __init__(self, files, *, pending_path, saved_files):
        self.files, self.pending_path, self.saved_files = files, pending_path, saved_files
        self.before = {path: read_text(path) for path, *_rest in files}
        self.created = self.before[files[0][0]] is None
        self.diffs = [
            dict(before_header=path if self.before[path] is not None else "/dev/null", after_header=path,
                 before=self.before[path] or "", after=text)
            for path, text, *_rest in files if self.before[path] != text
        ]
        self.content_changed = bool(self.diffs)
        self.attrs_changed = any(self.before[path] == text and file_needs_attrs(path, mode, uid, gid)
                                 for path, text, mode, uid, gid in files)
        # A restart owed by an earlier run that failed before restarting survives in the pending marker, so the
        # running process is never left on an old config because a previous play stopped half-way.
        self.pending_before = bool(pending_path) and os.path.exists(pending_path)
        # What runs now: while a restart is pending, the state saved before that change (read once); else what is
        # on disk.
        self.running = ({f["dest"]: read_text(f["saved"]) for f in saved_files} if self.pending_before
                        else self.before)
        # Back to what runs: while a restart is pending (a change was written, its restart failed or never came), a
        # render equal to the saved previous state is exactly what the process runs, so no restart is owed any more
        # (an inventory reverted after a failed change, docs/runbooks/rollback.md).
        self.back_to_running = self.pending_before and all(self.running[path] == text for path, text, *_rest in files)

    @property
    def changed(self):
        return self.content_changed or self.attrs_changed or self.back_to_running

    @property
    def restart_required(self):
        return (self.content_changed or self.pending_before) and not self.back_to_running

    def write(self, module, result, *, name, unit_name, uid, gid, render_root):
        """Write what changed; fails the module (with `result`) naming the file it could not write."""
        # The previous state (what runs now) is saved once per change, before anything is overwritten; a second run
        # while the restart is still pending must not replace it with the not-yet-running config.
        if self.content_changed and self.saved_files and not self.pending_before and not self.created:
            try:
                save_rollback(self.saved_files, self.before, uid=uid, gid=gid)
            except OSError as exc:
                rollback_dir = os.path.dirname(self.saved_files[0]["saved"])
                module.fail_json(msg=f"instance {name}: cannot save the previous state to {rollback_dir}: {exc}",
                                 **result)
        marker = self.pending_path
        if self.content_changed and not self.back_to_running and marker and os.path.isdir(os.path.dirname(marker)):
            try:
                atomic_write(marker, f"{unit_name}: unit or env changed; restart pending\n", 0o600, uid, None)
            except OSError as exc:
                module.fail_json(msg=f"instance {name}: cannot write {marker}: {exc}", **result)
        for path, text, mode, fuid, fgid in self.files:
            directory = os.path.dirname(path)
            if not os.path.isdir(directory):
                if render_root:
                    os.makedirs(directory, mode=0o755, exist_ok=True)
                else:
                    module.fail_json(
                        msg=f"instance {name}: directory {directory} does not exist; create it first", **result
                    )
            try:
                if read_text(path) != text:
                    atomic_write(path, text, mode, fuid, fgid)
                elif file_needs_attrs(path, mode, fuid, fgid):
                    set_attrs(path, mode, fuid, fgid)
            except OSError as exc:
                module.fail_json(msg=f"instance {name}: cannot write {path}: {exc}", **result)
        if self.back_to_running:
            try:
                os.unlink(marker)
            except FileNotFoundError:
                pass
