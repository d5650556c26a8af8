# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""One run of the model_weights module: check the parameters, plan (verify the revision directory, decide what to
fetch, remove and prune), check the disk space, then under the root's lock fetch, write the revision's manifest,
switch the served link and prune; in check mode only report what would happen.

Stdlib only (the AnsibleModule is passed in): runs on the managed hosts."""

import os
import time

from ansible_collections.b300.pd.plugins.module_utils.model_disk_space import free_bytes, human_bytes
from ansible_collections.b300.pd.plugins.module_utils.model_errors import WeightsError
from ansible_collections.b300.pd.plugins.module_utils.model_hashing import default_workers
from ansible_collections.b300.pd.plugins.module_utils.model_manifest import FETCHED, MISSING, REPAIRED
from ansible_collections.b300.pd.plugins.module_utils.weights_fetch import fetch_all
from ansible_collections.b300.pd.plugins.module_utils.weights_pin import PINNED, check_pinned, pin_manifest
from ansible_collections.b300.pd.plugins.module_utils.weights_plan import ContentPlan
from ansible_collections.b300.pd.plugins.module_utils.weights_report import (
    files_report,
    revisions_diff,
    state_counts,
    unreadable_records_warning,
)
from ansible_collections.b300.pd.plugins.module_utils.weights_retention import plan_retention, served_history
from ansible_collections.b300.pd.plugins.module_utils.weights_source import WeightsSource, check_params
from ansible_collections.b300.pd.plugins.module_utils.weights_store import RevisionStore, ServedLink, owner_ids

MIB = 1024 * 1024


class ModelWeights:
    """The model_weights module's work for one AnsibleModule: run() returns the result for exit_json."""

    def __init__(self, module):
        self.module = module
        p = module.params
        self.check = module.check_mode
        self.root = os.path.abspath(p["root"])
        self.revision = p["revision"]
        self.link = os.path.abspath(p["link"])
        self.keep = p["keep"]
        self.in_use_records = p["in_use_records"]
        self.deep = p["verify"] == "full"
        self.workers = p["workers"] or default_workers()
        self.dl_workers = max(1, p["download_workers"])
        self.bufsize = max(1, p["buffer_size_mib"]) * MIB
        self.margin = max(0, p["space_margin_mib"]) * MIB
        uid, gid = owner_ids(p["owner"], p["group"])
        self.store = RevisionStore(self.root, self.revision, uid, gid)
        self.source = WeightsSource(p, self.bufsize, module.run_command)
        self.pinned = None  # the manifest pinned on the control node (option manifest), checked in run()

    def plan(self):
        self.store.check_links()
        self.content = ContentPlan(self.store, self.source, self.workers, self.bufsize, self.deep,
                                   pinned=self.pinned).plan()
        self.served = ServedLink(self.link, self.store.revdir)
        self.retention = plan_retention(self.store, self.keep, self.in_use_records)

    def preflight(self):
        fs_path, free = free_bytes(self.root)
        fetch_bytes = self.content.fetch_bytes
        need = fetch_bytes + self.margin if self.content.todo else 0
        if need > free:
            raise WeightsError(
                f"not enough disk space for revision {self.revision} under {self.root} (filesystem of {fs_path}): "
                f"need {human_bytes(need)} ({human_bytes(fetch_bytes)} still to fetch + "
                f"{human_bytes(self.margin)} margin), free {human_bytes(free)}, short by {human_bytes(need - free)}; "
                "free space there or lower model_weights_keep"
            )

    def apply(self):
        """Make the planned changes under the root's lock; returns (changed, bytes transferred)."""
        with self.store.locked():
            return self._apply_locked()

    def _apply_locked(self):
        store, content = self.store, self.content
        changed = False
        transferred = 0
        os.close(store.tree_dir(f"revisions/{self.revision}"))
        if content.todo:
            transferred = fetch_all(store, self.source.fetcher(), content.todo, self.dl_workers, self.bufsize,
                                    authority=PINNED if self.pinned is not None else "the manifest")
            changed = True
        for rel in content.extra:
            store.remove_from_revision(rel)
            changed = True
        store.write_manifest(content.manifest, self.bufsize)
        store.remove_staging()
        if not self.served.ok:
            self.served.switch(store.makedirs)
            changed = True
        history = served_history(store)
        # Planned before the lock and the fetch: read the records again, so one written meanwhile still counts.
        self.retention = plan_retention(store, self.keep, self.in_use_records)
        for r in self.retention.to_prune:
            store.delete_revision(r)
            changed = True
        history = [r for r in history if r not in self.retention.to_prune]
        if history != store.history():
            store.write_history(history)
        return changed, transferred

    def run_pin(self):
        """Pin mode (option pin, on the control node): the pinned manifest of the revision, written when new."""
        check_params(self.module.params, self.link, pin_mode=True)
        changed, manifest = pin_manifest(self.module.params, self.source, self.check)
        return dict(changed=changed, pin=self.module.params["pin"], pinned=manifest is not None, manifest=manifest,
                    revision=self.revision)

    def run(self):
        t0 = time.monotonic()
        if self.module.params["pin"]:
            return self.run_pin()
        check_params(self.module.params, self.link)
        if self.module.params["manifest"] is not None:
            self.pinned = check_pinned(self.module.params["manifest"], self.revision)
        self.plan()
        if not self.check:
            self.preflight()
        content = self.content
        result = dict(
            revision=self.revision,
            revision_path=self.store.revdir,
            link=self.link,
            previous_target=self.served.current_target,
            fetch_bytes=content.fetch_bytes if content.todo else 0,
            transferred_bytes=0,
            removed=content.extra,
            manifest_origin=content.origin,
            pinned=self.pinned is not None,
        )
        if content.local_manifest_bad:
            used = PINNED if self.pinned is not None else "the source's"
            self.module.warn(f"ignored the revision's own manifest ({content.local_manifest_bad}); used {used}")
        revisions_before = list(self.retention.present)
        final = dict(content.states)
        if self.check:
            changed = bool(content.todo or content.extra or not self.served.ok or self.retention.to_prune)
            try:
                self.preflight()
            except WeightsError as e:
                self.module.warn(f"check mode: the real run would fail the disk preflight: {e}")
        else:
            changed, transferred = self.apply()
            result["transferred_bytes"] = transferred
            for f in content.todo:
                final[f["path"]] = FETCHED if content.states[f["path"]] == MISSING else REPAIRED
        retention = self.retention
        result.update(
            pruned=retention.to_prune,
            kept_in_use=retention.kept_in_use,
            in_use=dict(sorted(retention.in_use.items())),
            unreadable_records=retention.record_problems,
        )
        if retention.record_problems:
            self.module.warn(unreadable_records_warning(self.root, retention.record_problems))
        result["files"] = files_report(content.manifest, final)
        # What this host holds now (sha256 of every file once written): the first verified download's is pinned.
        result["manifest"] = self.store.written_manifest or {"revision": self.revision,
                                                             "files": content.manifest["files"]}
        result["summary"] = state_counts(final)
        result["elapsed_s"] = round(time.monotonic() - t0, 3)
        diff = revisions_diff(self.served, self.revision, revisions_before, retention)
        if diff is not None:
            result["diff"] = diff
        result["changed"] = changed
        return result
