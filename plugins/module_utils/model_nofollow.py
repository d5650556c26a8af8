# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Never following links in model_weights' own trees: directories opened beneath the root component by component
with O_NOFOLLOW, files opened with O_NOFOLLOW, paths through /proc/<pid>/fd, and a named error for a planted link.

The module runs as root and its trees (revisions/<rev>/, .staging/<rev>/) may be writable by model_weights_owner.
A symlink planted there must never be followed: every directory below the root is opened with O_NOFOLLOW relative
to its parent's fd, files are opened with O_NOFOLLOW, and renames/unlinks are dir_fd-relative.

Stdlib only: runs on the managed hosts and on the control node."""

import errno
import os
import stat

from ansible_collections.b300.pd.plugins.module_utils.model_errors import UnsafePathError

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
