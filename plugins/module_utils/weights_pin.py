# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The manifest pinned on the control node (issue #32): the file list and hashes of one revision, obtained once -
from the hub's listing (or an https mirror's manifest.json), else from the first verified download - and kept in a
file on the control node. Every host then checks its bytes against that manifest (module option `manifest`), so no
host - the seed host of the peer copy included - decides which files and hashes the others accept.

Pin mode (module option `pin`) runs on the control node and returns the pinned manifest: the pin file when it
exists; else the `manifest` given (the first verified download's), validated against the revision and written;
else, for a hub or mirror source, the source's manifest, written; else (a path or peer source not downloaded yet)
null: the role then lets the seed host make the first verified download and pins what it returns.

Stdlib only: runs on the control node (and on the managed hosts, as part of the model_weights module)."""

import copy
import os

from ansible_collections.b300.pd.plugins.module_utils.model_errors import ManifestError, WeightsError
from ansible_collections.b300.pd.plugins.module_utils.model_manifest import (
    dumps_manifest,
    manifest_differences,
    read_manifest_file,
    validate_manifest,
    write_atomic,
)

PINNED = "the manifest pinned on the control node"


def check_pinned(manifest, revision):
    """The `manifest` option (a pinned manifest) validated against the revision; a deep copy (fetches annotate it)."""
    try:
        return validate_manifest(copy.deepcopy(manifest), expected_revision=revision,
                                 origin=f"manifest ({PINNED})")
    except ManifestError as e:
        raise WeightsError(
            f"{e}; the pin file under model_weights_pin_dir on the control node is damaged or for another revision: "
            "delete it and rerun to pin the revision again"
        ) from None


def pin_manifest(params, source, check_mode):
    """Pin mode: (changed, manifest or None). params are the module's; source a WeightsSource."""
    path = params["pin"]
    revision = params["revision"]
    given = params["manifest"]
    if not os.path.isabs(path) or not path.endswith(".manifest.json"):
        raise WeightsError(
            f"pin {path!r} must be an absolute path on the control node ending in .manifest.json "
            "(model_weights_pin_dir / model_weights_pin_name)"
        )
    path = os.path.normpath(path)
    if os.path.lexists(path):
        try:
            pinned = validate_manifest(read_manifest_file(path), expected_revision=revision, origin=path)
        except ManifestError as e:
            raise WeightsError(
                f"the pinned manifest {path} is not usable: {e}; it is the authority every host checks against, so "
                "nothing is fetched: check who changed it, delete it and rerun to pin the revision again"
            ) from None
        if given is not None:
            diff = manifest_differences(given, pinned)
            if diff:
                raise WeightsError(
                    f"the first verified download differs from the manifest pinned in {path}: " + "; ".join(diff[:5])
                    + "; refused: check the host that made the download"
                )
        return False, pinned
    if given is not None:
        manifest = check_pinned(given, revision)
        if any("sha256" not in f for f in manifest["files"]):
            raise WeightsError(f"the manifest given for pin {path} lacks a sha256 for some files; pin a download "
                               "whose every file was hashed (the model_weights module's returned manifest)")
        manifest = {"revision": manifest["revision"], "files": manifest["files"]}
    elif params["source"]["type"] in ("hf", "http"):
        try:
            manifest = source.manifest()
        except ManifestError as e:
            raise WeightsError(
                f"cannot pin revision {revision} on the control node: {e}; the control node must reach the source "
                "once (the hosts never take the file list from each other)"
            ) from None
    else:
        return False, None
    if not check_mode:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        write_atomic(path, dumps_manifest(manifest))
    return True, manifest
