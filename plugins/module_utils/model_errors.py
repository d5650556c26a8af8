# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The errors of the model weights code (manifests, fetchers, the model_weights module): their own module so the
low-level helpers (model_nofollow) and the manifest code can both raise them without importing each other.

Stdlib only: runs on the managed hosts and on the control node."""


class ManifestError(Exception):
    """Bad manifest, revision mismatch or a source that cannot deliver a file."""


class UnsafePathError(ManifestError):
    """A symlink (or a non-directory) where model_weights expects a directory or file of its own tree."""


class WeightsError(Exception):
    """A model_weights run that cannot go on (bad parameters, short disk, a file the source cannot deliver)."""
