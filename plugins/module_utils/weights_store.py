# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The model_weights module's tree under its root, on disk: revisions/<rev>/, .staging/<rev>/, the lock, the history
of served revisions, the revision's own manifest.json, and the served symlink switched atomically.

Everything below the root is reached without following links (model_nofollow): the module runs as root and
model_weights_owner may write these trees. Stdlib only: runs on the managed hosts."""

import contextlib
import fcntl
import grp
import json
import os
import posixpath
import pwd
import shutil

from ansible_collections.b300.pd.plugins.module_utils.model_errors import WeightsError
from ansible_collections.b300.pd.plugins.module_utils.model_hashing import hash_stream
from ansible_collections.b300.pd.plugins.module_utils.model_manifest import (
    MANIFEST_NAME,
    PART_SUFFIX,
    dumps_manifest,
    list_files,
    write_atomic,
)
from ansible_collections.b300.pd.plugins.module_utils.model_nofollow import (
    open_dir_beneath,
    open_nofollow,
    scan_links,
    symlink_error,
)

HISTORY_NAME = ".served-history.json"
LOCK_NAME = ".lock"


def owner_ids(owner, group):
    """(uid, gid) of the owner and group the module gives what it creates; -1 for "leave as the connecting user"."""
    try:
        uid = pwd.getpwnam(owner).pw_uid if owner else -1
    except KeyError:
        raise WeightsError(f"owner {owner!r} is not a user on this host; create it or fix owner") from None
    try:
        gid = grp.getgrnam(group).gr_gid if group else -1
    except KeyError:
        raise WeightsError(f"group {group!r} is not a group on this host; create it or fix group") from None
    return uid, gid


class RevisionStore:
    """root/revisions/<revision>/ and root/.staging/<revision>/ of one run, with what the module keeps beside them."""

    def __init__(self, root, revision, uid=-1, gid=-1):
        self.root = root
        self.revision = revision
        self.revs_dir = os.path.join(root, "revisions")
        self.revdir = os.path.join(self.revs_dir, revision)
        self.staging = os.path.join(root, ".staging", revision)
        self.uid = uid
        self.gid = gid
        self.written_manifest = None  # the revision's manifest.json as write_manifest left it
        # Paths through /proc/<pid>/fd/<dir fd>/ reach a directory we opened without following links, so nobody can
        # swap one of its parents for a symlink between our check and a fetcher's (or rsync's) write.
        self.proc_fds = os.path.isdir(f"/proc/{os.getpid()}/fd")

    # ------------------------------------------------------------ ownership and directories

    def own(self, path):
        if self.uid != -1 or self.gid != -1:
            os.chown(path, self.uid, self.gid)

    def own_fd(self, fd):
        if self.uid != -1 or self.gid != -1:
            os.fchown(fd, self.uid, self.gid)

    def tree_dir(self, rel):
        """Make root/rel (inside the module's own trees) without following any link below the root; returns its fd."""
        return open_dir_beneath(self.root, rel, create=True, on_create=self.own_fd)

    def makedirs(self, path):
        missing = []
        p = path
        while not os.path.isdir(p):
            missing.append(p)
            p = os.path.dirname(p)
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o755)
            except FileExistsError:
                continue
            os.chmod(d, 0o755)  # noqa: S103 (world-readable on purpose: pd_vllm_user reads the model)
            self.own(d)

    # ------------------------------------------------------------ reading the trees

    def check_links(self):
        """Refuse any symlink in the trees this module writes, before anything is read or written there.

        A named error rather than removing the link: neither this module nor rsync nor vLLM ever makes one there, so
        a link is tampering (model_weights_owner may write the tree; the module runs as root) or a hand edit, and
        silently unlinking it would hide that. Unlinking would also not be enough against a race, so every write
        below is additionally O_NOFOLLOW / dir_fd-relative (a link planted after this check is an error too).
        """
        for rel in ("revisions", f"revisions/{self.revision}", ".staging", f".staging/{self.revision}", LOCK_NAME,
                    HISTORY_NAME):
            full = os.path.join(self.root, rel)
            if os.path.islink(full):
                raise symlink_error(full)
        found = []
        for tree in (self.revdir, self.staging):
            if os.path.isdir(tree):
                found += [os.path.join(tree, r) for r in scan_links(tree)]
        if os.path.isdir(self.revs_dir):
            found += sorted(
                os.path.join(self.revs_dir, d) for d in os.listdir(self.revs_dir)
                if os.path.islink(os.path.join(self.revs_dir, d))
            )
        if len(found) == 1:
            raise symlink_error(found[0])
        if found:
            shown = ", ".join(f"{p} -> {os.readlink(p)}" for p in found[:10])
            raise WeightsError(
                f"{len(found)} symlinks inside the trees model_weights writes under {self.root}, which it never "
                f"follows (run as root, a planted link would make it write outside the root): {shown}; check who "
                "made them, remove them (rm <path>) and rerun"
            )

    def extras(self, manifest):
        """Files in the revision directory that manifest does not list."""
        listed = {f["path"] for f in manifest["files"]}
        return sorted(set(list_files(self.revdir)) - listed) if os.path.isdir(self.revdir) else []

    def bytes_to_fetch(self, todo):
        """Bytes of the todo entries not yet staged as .part files (a .part longer than its file counts as none)."""
        total = 0
        for f in todo:
            part = os.path.join(self.staging, f["path"] + PART_SUFFIX)
            have = os.path.getsize(part) if os.path.isfile(part) else 0
            total += f["size"] - (have if have <= f["size"] else 0)
        return total

    def present_revisions(self):
        """Revision directories on disk (names, unsorted); [] before the first run."""
        if not os.path.isdir(self.revs_dir):
            return []
        return [
            d for d in os.listdir(self.revs_dir)
            if os.path.isdir(os.path.join(self.revs_dir, d)) and not d.startswith(".")
        ]

    def revision_mtime(self, revision):
        return os.stat(os.path.join(self.revs_dir, revision)).st_mtime

    def history(self):
        """The revisions served so far, most recent first ([] when the file is missing or unreadable)."""
        try:
            with open(os.path.join(self.root, HISTORY_NAME), encoding="utf-8") as fh:
                h = json.load(fh)
            return [r for r in h if isinstance(r, str)] if isinstance(h, list) else []
        except (OSError, ValueError):
            return []

    # ------------------------------------------------------------ writing the trees

    @contextlib.contextmanager
    def locked(self):
        """Hold root/.lock for the block; another run already holding it is a WeightsError."""
        self.makedirs(self.root)
        lock_fd = open_nofollow(os.path.join(self.root, LOCK_NAME), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise WeightsError(f"another model_weights run holds {self.root}/{LOCK_NAME}") from None
            yield
        finally:
            os.close(lock_fd)

    def remove_from_revision(self, rel):
        rel_dir, name = posixpath.split(rel)
        dir_fd = open_dir_beneath(self.root, posixpath.join("revisions", self.revision, rel_dir))
        try:
            os.unlink(name, dir_fd=dir_fd)  # the entry itself, never what a link would point to
        finally:
            os.close(dir_fd)

    def write_manifest(self, manifest, bufsize):
        """Write the revision's own manifest.json (sha256 for every file) when it differs; returns True if written."""
        files = []
        for f in manifest["files"]:
            sha = f.get("sha256") or self._hash_served(f["path"], bufsize)
            files.append({"path": f["path"], "size": f["size"], "sha256": sha})
        norm = {"revision": self.revision, "files": files}
        self.written_manifest = norm
        dir_fd = open_dir_beneath(self.root, f"revisions/{self.revision}")
        try:
            try:
                with os.fdopen(open_nofollow(MANIFEST_NAME, os.O_RDONLY, dir_fd=dir_fd), encoding="utf-8") as fh:
                    if json.load(fh) == norm:
                        return False
            except (OSError, ValueError):
                pass
            write_atomic(MANIFEST_NAME, dumps_manifest(norm), dir_fd=dir_fd)
            if self.uid != -1 or self.gid != -1:
                os.chown(MANIFEST_NAME, self.uid, self.gid, dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.close(dir_fd)
        return True

    def _hash_served(self, rel, bufsize):
        rel_dir, name = posixpath.split(rel)
        dir_fd = open_dir_beneath(self.root, posixpath.join("revisions", self.revision, rel_dir))
        try:
            with os.fdopen(open_nofollow(name, os.O_RDONLY, dir_fd=dir_fd), "rb", buffering=0) as fh:
                return hash_stream(fh, bufsize)[1][0]
        finally:
            os.close(dir_fd)

    def remove_staging(self):
        if os.path.isdir(self.staging):
            shutil.rmtree(self.staging)

    def delete_revision(self, revision):
        shutil.rmtree(os.path.join(self.revs_dir, revision), ignore_errors=False)
        shutil.rmtree(os.path.join(self.root, ".staging", revision), ignore_errors=True)

    def write_history(self, history):
        write_atomic(os.path.join(self.root, HISTORY_NAME), json.dumps(history) + "\n")


class ServedLink:
    """The served path (pd_model_path): a relative symlink to the revision directory, switched atomically."""

    def __init__(self, link, revdir):
        self.link = link
        self.want_target = os.path.relpath(revdir, os.path.dirname(link))
        self.current_target = os.readlink(link) if os.path.islink(link) else None
        self.ok = self.current_target is not None and (
            self.current_target == self.want_target
            or os.path.realpath(link) == os.path.realpath(revdir)
        )

    def switch(self, makedirs):
        """Point the link at the revision: a symlink under a temporary name, renamed over the link (never absent)."""
        makedirs(os.path.dirname(self.link))
        tmp = f"{self.link}.tmp-{os.getpid()}"
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(self.want_target, tmp)
        os.replace(tmp, self.link)
