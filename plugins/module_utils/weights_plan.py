# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What model_weights must do to the revision directory: which manifest is the authority (the revision's own
manifest.json when it is sound, else the source's), the state of each file against it, what must be fetched and how
many bytes that is, and which files do not belong there.

Stdlib only: runs on the managed hosts."""

import os

from ansible_collections.b300.pd.plugins.module_utils.model_errors import ManifestError, WeightsError
from ansible_collections.b300.pd.plugins.module_utils.model_manifest import (
    MANIFEST_NAME,
    OK,
    SHA256_RE,
    manifest_differences,
    read_manifest_file,
    validate_manifest,
    verify_files,
)
from ansible_collections.b300.pd.plugins.module_utils.weights_pin import PINNED


class ContentPlan:
    """The plan for one revision directory (RevisionStore) from one source (WeightsSource).

    After plan(): manifest (the authority), origin ("local" or the source's description), states ({path: state}),
    extra (files not in the manifest), todo (entries to fetch), fetch_bytes (of todo, staged bytes excluded) and
    local_manifest_bad (why the revision's own manifest.json was not used, or None).
    """

    def __init__(self, store, source, workers, bufsize, deep, *, pinned=None):
        self.store = store
        self.source = source
        self.workers = workers
        self.bufsize = bufsize
        self.deep = deep
        self.pinned = pinned
        self.local_manifest_bad = None

    def plan(self):
        if self.pinned is not None:
            return self._plan_pinned()
        store = self.store
        local_path = os.path.join(store.revdir, MANIFEST_NAME)
        manifest = None
        origin = "local"
        self.local_manifest_bad = None
        if os.path.exists(local_path):
            try:
                manifest = validate_manifest(
                    read_manifest_file(local_path), expected_revision=store.revision, origin=local_path
                )
            except ManifestError as e:
                self.local_manifest_bad = str(e)
                manifest = None
        if manifest is None:
            manifest = self.source.manifest()
            origin = self.source.describe()
        states = verify_files(store.revdir, manifest["files"], workers=self.workers, bufsize=self.bufsize,
                              deep=self.deep)
        if origin == "local" and any(s != OK for s in states.values()):
            # Something must be fetched: the source is the authority on what the revision holds.
            src_manifest = self.source.manifest()
            origin = self.source.describe()
            states = self._reconcile(manifest, src_manifest, states)
            manifest = src_manifest
        extra = store.extras(manifest)
        if origin == "local" and extra and not SHA256_RE.match(store.revision):
            # Deleting on the word of a manifest that cannot vouch for itself (a hub commit id is not a hash of the
            # file list) would let an edited manifest.json delete real shards: confirm it with the source first.
            manifest, states, extra = self._confirm_with_source(local_path, manifest, states, extra)
            if self.local_manifest_bad:
                origin = self.source.describe()
        self.manifest = manifest
        self.origin = origin
        self.states = states
        self.extra = extra
        self.todo = [f for f in manifest["files"] if states[f["path"]] != OK]
        self.fetch_bytes = store.bytes_to_fetch(self.todo)
        return self

    def _plan_pinned(self):
        """The manifest pinned on the control node is the authority: neither the revision's own manifest.json nor
        the source's (a peer's) is read for the file list; every file is checked against the pin, what differs is
        fetched and checked against it again, what it does not list is removed."""
        store = self.store
        manifest = self.pinned
        local_path = os.path.join(store.revdir, MANIFEST_NAME)
        self.local_manifest_bad = None
        if os.path.exists(local_path):
            try:
                diff = manifest_differences(read_manifest_file(local_path), manifest)
            except (ManifestError, KeyError, TypeError) as e:
                diff = [f"unreadable: {e}"]
            if diff:
                self.local_manifest_bad = (f"{local_path} differs from {PINNED}: " + "; ".join(diff[:5])
                                           + (f" (+{len(diff) - 5} more)" if len(diff) > 5 else ""))
        self.manifest = manifest
        self.origin = f"{self.source.describe()}, checked against {PINNED}"
        self.states = verify_files(store.revdir, manifest["files"], workers=self.workers, bufsize=self.bufsize,
                                   deep=self.deep)
        self.extra = store.extras(manifest)
        self.todo = [f for f in manifest["files"] if self.states[f["path"]] != OK]
        self.fetch_bytes = store.bytes_to_fetch(self.todo)
        return self

    def _confirm_with_source(self, local_path, manifest, states, extra):
        try:
            src_manifest = self.source.manifest()
        except ManifestError as e:
            shown = ", ".join(extra[:5]) + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else "")
            raise WeightsError(
                f"{len(extra)} file(s) in {self.store.revdir} are not in its manifest.json ({shown}) and would be "
                f"deleted, but revision {self.store.revision} is not a content hash, so its local manifest cannot "
                f"vouch for itself and the source could not confirm it: {e}; rerun when the source is reachable (or, "
                "if they really are strays, remove them by hand)"
            ) from None
        diff = manifest_differences(manifest, src_manifest)
        if not diff:
            return manifest, states, extra
        self.local_manifest_bad = (
            f"{local_path} differs from {self.source.describe()}: " + "; ".join(diff[:5])
            + (f" (+{len(diff) - 5} more)" if len(diff) > 5 else "")
        )
        states = self._reconcile(manifest, src_manifest, states)
        return src_manifest, states, self.store.extras(src_manifest)

    def _reconcile(self, local, source, states):
        """States against the source's manifest: a file the local manifest listed the same keeps its state, the rest
        are verified again (deep)."""
        by_path = {f["path"]: f for f in local["files"]}
        redo = []
        out = {}
        for f in source["files"]:
            lf = by_path.get(f["path"])
            same = lf is not None and lf["size"] == f["size"] and (
                ("sha256" in f and lf.get("sha256") == f["sha256"]) or ("sha256" not in f)
            )
            if same and f["path"] in states:
                out[f["path"]] = states[f["path"]]
                if "sha256" not in f and lf.get("sha256"):
                    f["sha256"] = lf["sha256"]  # checked locally before; the hub only gave a git blob id
            else:
                redo.append(f)
        if redo:
            out.update(verify_files(self.store.revdir, redo, workers=self.workers, bufsize=self.bufsize, deep=True))
        return out
