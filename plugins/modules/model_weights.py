#!/usr/bin/python
# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

import errno
import grp
import json
import os
import posixpath
import pwd
import re
import shutil
import stat
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.b300.pd.plugins.module_utils.model_manifest import (
    FETCHED,
    MANIFEST_NAME,
    MISSING,
    OK,
    PART_SUFFIX,
    REPAIRED,
    SHA1_RE,
    SHA256_RE,
    HfFetcher,
    HttpFetcher,
    ManifestError,
    PathFetcher,
    RsyncFetcher,
    default_workers,
    dumps_manifest,
    fd_path,
    free_bytes,
    hash_stream,
    list_files,
    manifest_differences,
    open_dir_beneath,
    open_nofollow,
    read_manifest_file,
    revisions_in_use,
    scan_links,
    symlink_error,
    validate_manifest,
    verify_files,
    write_atomic,
)

DOCUMENTATION = r"""
---
module: model_weights
short_description: Pinned, manifest-verified, resumable model directory with an atomically switched served symlink
description:
  - "Ensures C(<root>/revisions/<revision>/) holds exactly the files of the revision's manifest
    (JSON object with C(revision) and C(files), a list of C(path), C(size), C(sha256)) and that O(link) is a symlink
    to it."
  - Verification checks sizes first, then the sha256 of every file with a pool of threads (large reads; hashlib
    releases the GIL). Each file is reported as V(ok), V(missing), V(size_mismatch), V(checksum_mismatch),
    V(fetched) or V(repaired).
  - Missing or corrupt files are fetched into C(<root>/.staging/<revision>/<path>.part), resumed by byte offset
    (HTTP Range, rsync --append, copy from offset), verified, and only then moved into the revision directory. A
    corrupted shard of the served revision is replaced by an atomic rename of a verified copy, so a half-copied shard
    is never visible under the revision directory.
  - A disk-space preflight (bytes still to fetch + O(space_margin_mib)) runs before anything is written.
  - The served symlink is switched atomically (symlink to a temporary name, then rename over O(link)); revisions
    beyond the O(keep) most recently served are deleted, except those a vLLM instance record (O(in_use_records))
    names.
  - The manifest of an already complete revision is read from C(<root>/revisions/<revision>/manifest.json), so a
    healthy host does not need the source; the source is contacted only when something has to be fetched.
  - Revisions that are 64 hex digits are content addresses (sha256 of the canonical file list, see
    C(scripts/model-manifest)) and are checked against the manifest's file list.
version_added: "1.0.0"
author: b300-pd contributors
extends_documentation_fragment:
  - b300.pd.attributes
attributes:
  check_mode:
    support: full
    details: Reports per-file state, what would be fetched and how many bytes; touches nothing.
  diff_mode:
    support: partial
    details: Shows the served symlink target and the revisions on disk before and after, and the revisions kept
      beyond O(keep) because an instance record names them (with the records).
options:
  root:
    description: Directory holding C(revisions/), C(.staging/) and the bookkeeping files.
    type: path
    required: true
  revision:
    description:
      - The revision to serve. For O(source.type=hf) the full 40-hex commit id; for a locally generated model the
        64-hex content revision written by C(scripts/model-manifest).
    type: str
    required: true
  link:
    description: The served path (C(pd_model_path)); made a symlink to C(<root>/revisions/<revision>), relative.
    type: path
    required: true
  source:
    description: Where missing files come from.
    type: dict
    required: true
    suboptions:
      type:
        description: V(hf) Hugging Face hub, V(http) a mirror, V(path) a directory, V(peer) rsync from a cluster host.
        type: str
        required: true
        choices: [hf, http, path, peer]
      revision:
        description: The source's pinned revision as the inventory carries it; must equal O(revision) when set.
        type: str
      repo_id:
        description: Hub repository (V(hf)).
        type: str
      endpoint:
        description: Hub base URL (V(hf)).
        type: str
        default: https://huggingface.co
      url:
        description: Mirror base URL serving C(<url>/manifest.json) and C(<url>/<path>) (V(http)).
        type: str
      path:
        description:
          - Directory with C(manifest.json) and the files (V(path)), or the revision directory on the peer (V(peer)).
        type: path
      host:
        description: Peer address for rsync over ssh (V(peer)); empty means a local directory (tests).
        type: str
      user:
        description: ssh user on the peer (V(peer)).
        type: str
      port:
        description: ssh port on the peer (V(peer)).
        type: int
      ssh_key:
        description: Private key on this host used to reach the peer (V(peer)).
        type: path
      ssh_args:
        description: Extra ssh options (V(peer)).
        type: list
        elements: str
        default: []
  token:
    description: Bearer token for V(hf) and V(http) sources (C(pd_hf_token) from the vault).
    type: str
  keep:
    description: How many served revisions to keep (the current one included) for rollback.
    type: int
    default: 2
  in_use_records:
    description:
      - Absolute glob patterns of the vLLM instance records (JSON written by C(vllm_instance), schema 1). A
        revision that any matching record names is never pruned, whatever O(keep) says - its field
        C(model_revision), or the last component of C(model_path) when that lies in C(<root>/revisions/).
      - A record describes what an instance's unit on disk runs (C(/etc/vllm/<name>.record.json)) or its rollback
        target (C(/etc/vllm/rollback/<name>.record.json)); deleting that revision would leave an instance that cannot
        (re)start or roll back.
      - Fail safe - when a matching record cannot be read or understood (not JSON, not schema 1, no absolute
        C(model_path)), nothing is pruned in this run and a warning names the file.
    type: list
    elements: str
    default: []
  verify:
    description: V(full) hashes every file of the revision on every run; V(size) checks sizes only (fetched files are
      always hashed).
    type: str
    default: full
    choices: [full, size]
  workers:
    description: Hashing threads; 0 means min(16, CPUs).
    type: int
    default: 0
  download_workers:
    description: Files fetched in parallel.
    type: int
    default: 4
  buffer_size_mib:
    description: Read/copy buffer size.
    type: int
    default: 16
  space_margin_mib:
    description: Free space that must remain after the fetch (disk preflight).
    type: int
    default: 1024
  timeout:
    description: HTTP timeout in seconds (per request / read).
    type: int
    default: 60
  retries:
    description: HTTP retries per file within one run (each retry resumes from the bytes already staged).
    type: int
    default: 3
  owner:
    description: Owner of the directories and files this module creates (default the connecting user).
    type: str
  group:
    description: Group of the directories and files this module creates.
    type: str
notes:
  - Directories are created C(0755) and files C(0644), so any local user (C(pd_vllm_user)) can read the model.
  - O(source.type=hf) talks to the hub's REST API directly (C(/api/models/<repo>/revision/<rev>?blobs=true), the
    endpoint behind C(HfApi.model_info(files_metadata=True))) and downloads C(/<repo>/resolve/<rev>/<file>) with
    Range requests; no C(huggingface_hub) is needed on the hosts. Non-LFS files are checked by their git blob id.
  - O(source.type=peer) runs C(rsync) over C(ssh) from this host to the peer; this host needs C(rsync) and an ssh
    key the peer accepts (see the model_weights role README).
"""

EXAMPLES = r"""
- name: Serve GLM-5.2-NVFP4 at a pinned hub commit
  b300.pd.model_weights:
    root: /mnt/model/glm
    link: /mnt/model/glm/GLM-5.2-NVFP4
    revision: 0123456789abcdef0123456789abcdef01234567
    source:
      type: hf
      repo_id: zai-org/GLM-5.2-NVFP4
    token: "{{ pd_hf_token }}"

- name: Copy the revision from the first host
  b300.pd.model_weights:
    root: /mnt/model/glm
    link: /mnt/model/glm/GLM-5.2-NVFP4
    revision: 0123456789abcdef0123456789abcdef01234567
    source:
      type: peer
      host: 10.0.0.11
      user: root
      path: /mnt/model/glm/revisions/0123456789abcdef0123456789abcdef01234567

- name: A locally generated model on shared storage
  b300.pd.model_weights:
    root: /srv/models
    link: /srv/models/tiny-pd
    revision: "{{ lookup('ansible.builtin.file', 'tiny-pd.REVISION') }}"
    source:
      type: path
      path: /srv/model-src/tiny-pd
"""

RETURN = r"""
revision:
  description: The served revision.
  returned: always
  type: str
revision_path:
  description: C(<root>/revisions/<revision>).
  returned: always
  type: str
link:
  description: The served symlink.
  returned: always
  type: str
previous_target:
  description: Where O(link) pointed before (null when it did not exist).
  returned: always
  type: str
files:
  description: Per-file state (ok, missing, size_mismatch, checksum_mismatch in check mode; ok, fetched, repaired).
  returned: always
  type: list
  elements: dict
  sample: [{"path": "model-00001-of-00002.safetensors", "size": 5368709120, "state": "ok"}]
summary:
  description: Number of files per state.
  returned: always
  type: dict
  sample: {"ok": 81, "repaired": 1}
fetch_bytes:
  description: Bytes still to fetch when the run started (already staged .part bytes excluded).
  returned: always
  type: int
transferred_bytes:
  description: Bytes actually transferred from the source in this run.
  returned: always
  type: int
removed:
  description: Files in the revision directory that are not in the manifest, removed (or that would be).
  returned: always
  type: list
  elements: str
pruned:
  description: Old revisions deleted (or that would be) beyond O(keep).
  returned: always
  type: list
  elements: str
kept_in_use:
  description: Revisions beyond O(keep) that were not pruned because an instance record names them.
  returned: always
  type: list
  elements: str
  sample: ["3f0c...e1"]
in_use:
  description: Every revision of this root named by an instance record (O(in_use_records)), with the records.
  returned: always
  type: dict
  sample: {"3f0c...e1": ["/etc/vllm/rollback/prefill-0.record.json"]}
unreadable_records:
  description: "Matching records that could not be read or understood (C(<path>: <why>)); when not empty nothing was
    pruned."
  returned: always
  type: list
  elements: str
manifest_origin:
  description: V(local) when the revision's own manifest.json was used, else the source description.
  returned: always
  type: str
"""

REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
HISTORY_NAME = ".served-history.json"
LOCK_NAME = ".lock"
MIB = 1024 * 1024


class WeightsError(Exception):
    pass


def _fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024.0
    return str(n)


class ModelWeights:
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
        self.revdir = os.path.join(self.root, "revisions", self.revision)
        self.staging = os.path.join(self.root, ".staging", self.revision)
        try:
            self.uid = pwd.getpwnam(p["owner"]).pw_uid if p["owner"] else -1
        except KeyError:
            raise WeightsError(f"owner {p['owner']!r} is not a user on this host; create it or fix owner") from None
        try:
            self.gid = grp.getgrnam(p["group"]).gr_gid if p["group"] else -1
        except KeyError:
            raise WeightsError(f"group {p['group']!r} is not a group on this host; create it or fix group") from None
        # Paths through /proc/<pid>/fd/<dir fd>/ reach a directory we opened without following links, so nobody can
        # swap one of its parents for a symlink between our check and a fetcher's (or rsync's) write.
        self.proc_fds = os.path.isdir(f"/proc/{os.getpid()}/fd")
        self._fetcher = None

    # ------------------------------------------------------------ inputs

    def validate(self):
        src = self.module.params["source"]
        if not REVISION_RE.match(self.revision):
            raise WeightsError(f"revision {self.revision!r} is not a plain revision id ([A-Za-z0-9._-], no '/')")
        if self.keep < 1:
            raise WeightsError(f"keep must be >= 1 (got {self.keep})")
        relative = [p for p in self.in_use_records if not p.startswith("/")]
        if relative:
            raise WeightsError(
                f"in_use_records {relative} must be absolute glob patterns (e.g. /etc/vllm/*.record.json): a relative "
                "one would be read from wherever the module happens to run (model_weights_in_use_records)"
            )
        t = src["type"]
        if src.get("revision") and src["revision"] != self.revision:
            raise WeightsError(f"source.revision {src['revision']} differs from revision {self.revision}")
        if t == "hf":
            if not src.get("repo_id"):
                raise WeightsError("source.repo_id is required for source.type=hf")
            if not SHA1_RE.match(self.revision):
                raise WeightsError(
                    f"revision {self.revision!r} for hf repo {src['repo_id']} must be a full 40-hex commit id "
                    "(pin pd_model_source.revision; branch names and tags move)"
                )
        elif t == "http" and not src.get("url"):
            raise WeightsError("source.url is required for source.type=http")
        elif t in ("path", "peer") and not src.get("path"):
            raise WeightsError(f"source.path is required for source.type={t}")
        if self.module.params["token"] and t in ("hf", "http"):
            field, url = ("source.endpoint", src["endpoint"]) if t == "hf" else ("source.url", src["url"])
            if urllib.parse.urlsplit(url).scheme.lower() != "https":
                raise WeightsError(
                    f"{field} {url} is not https but a token is set: the token (model_weights_token / pd_hf_token) "
                    f"would travel in clear text; use an https:// {field.split('.')[1]}, or unset the token for a "
                    "source that needs none"
                )
        if os.path.lexists(self.link) and not os.path.islink(self.link):
            raise WeightsError(
                f"{self.link} exists and is not a symlink; move it away (it is the served path model_weights manages)"
            )

    def fetcher(self):
        if self._fetcher is None:
            p = self.module.params
            src = p["source"]
            t = src["type"]
            if t == "hf":
                self._fetcher = HfFetcher(
                    src["repo_id"], self.revision, endpoint=src["endpoint"], token=p["token"],
                    timeout=p["timeout"], bufsize=self.bufsize, retries=p["retries"],
                )
            elif t == "http":
                self._fetcher = HttpFetcher(
                    src["url"], token=p["token"], timeout=p["timeout"], bufsize=self.bufsize, retries=p["retries"]
                )
            elif t == "path":
                self._fetcher = PathFetcher(src["path"], bufsize=self.bufsize)
            else:
                self._fetcher = RsyncFetcher(
                    self.module.run_command, src["path"], host=src.get("host"), user=src.get("user"),
                    port=src.get("port"), ssh_key=src.get("ssh_key"), ssh_args=src.get("ssh_args"),
                )
        return self._fetcher

    def source_manifest(self):
        f = self.fetcher()
        if isinstance(f, RsyncFetcher):
            tmp = tempfile.mkdtemp(prefix="model-weights-")
            try:
                m = f.manifest(tmp)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        else:
            m = f.manifest()
        return validate_manifest(m, expected_revision=self.revision, origin=f"source {f.describe()}")

    # ------------------------------------------------------------ plan

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
        revs_dir = os.path.join(self.root, "revisions")
        if os.path.isdir(revs_dir):
            found += sorted(
                os.path.join(revs_dir, d) for d in os.listdir(revs_dir) if os.path.islink(os.path.join(revs_dir, d))
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

    def _extras(self, manifest):
        listed = {f["path"] for f in manifest["files"]}
        return sorted(set(list_files(self.revdir)) - listed) if os.path.isdir(self.revdir) else []

    def plan(self):
        self.check_links()
        local_path = os.path.join(self.revdir, MANIFEST_NAME)
        manifest = None
        origin = "local"
        self.local_manifest_bad = None
        if os.path.exists(local_path):
            try:
                manifest = validate_manifest(
                    read_manifest_file(local_path), expected_revision=self.revision, origin=local_path
                )
            except ManifestError as e:
                self.local_manifest_bad = str(e)
                manifest = None
        if manifest is None:
            manifest = self.source_manifest()
            origin = self.fetcher().describe()
        states = verify_files(self.revdir, manifest["files"], workers=self.workers, bufsize=self.bufsize,
                              deep=self.deep)
        if origin == "local" and any(s != OK for s in states.values()):
            # Something must be fetched: the source is the authority on what the revision holds.
            src_manifest = self.source_manifest()
            origin = self.fetcher().describe()
            states = self._reconcile(manifest, src_manifest, states)
            manifest = src_manifest
        extra = self._extras(manifest)
        if origin == "local" and extra and not SHA256_RE.match(self.revision):
            # Deleting on the word of a manifest that cannot vouch for itself (a hub commit id is not a hash of the
            # file list) would let an edited manifest.json delete real shards: confirm it with the source first.
            manifest, states, extra = self._confirm_with_source(local_path, manifest, states, extra)
            if self.local_manifest_bad:
                origin = self.fetcher().describe()
        self.manifest = manifest
        self.origin = origin
        self.states = states
        self.extra = extra
        self.todo = [f for f in manifest["files"] if states[f["path"]] != OK]
        self.fetch_bytes = 0
        for f in self.todo:
            part = os.path.join(self.staging, f["path"] + PART_SUFFIX)
            have = os.path.getsize(part) if os.path.isfile(part) else 0
            self.fetch_bytes += f["size"] - (have if have <= f["size"] else 0)
        self.want_target = os.path.relpath(self.revdir, os.path.dirname(self.link))
        self.current_target = os.readlink(self.link) if os.path.islink(self.link) else None
        self.link_ok = self.current_target is not None and (
            self.current_target == self.want_target
            or os.path.realpath(self.link) == os.path.realpath(self.revdir)
        )
        self.to_prune = self._prune_plan()

    def _confirm_with_source(self, local_path, manifest, states, extra):
        try:
            src_manifest = self.source_manifest()
        except ManifestError as e:
            shown = ", ".join(extra[:5]) + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else "")
            raise WeightsError(
                f"{len(extra)} file(s) in {self.revdir} are not in its manifest.json ({shown}) and would be deleted, "
                f"but revision {self.revision} is not a content hash, so its local manifest cannot vouch for itself "
                f"and the source could not confirm it: {e}; rerun when the source is reachable (or, if they really "
                "are strays, remove them by hand)"
            ) from None
        diff = manifest_differences(manifest, src_manifest)
        if not diff:
            return manifest, states, extra
        self.local_manifest_bad = (
            f"{local_path} differs from {self.fetcher().describe()}: " + "; ".join(diff[:5])
            + (f" (+{len(diff) - 5} more)" if len(diff) > 5 else "")
        )
        states = self._reconcile(manifest, src_manifest, states)
        return src_manifest, states, self._extras(src_manifest)

    def _reconcile(self, local, source, states):
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
            out.update(verify_files(self.revdir, redo, workers=self.workers, bufsize=self.bufsize, deep=True))
        return out

    def _write_manifest(self):
        """Write the revision's own manifest.json (sha256 for every file) when it differs; returns True if written."""
        files = []
        for f in self.manifest["files"]:
            sha = f.get("sha256") or self._hash_served(f["path"])
            files.append({"path": f["path"], "size": f["size"], "sha256": sha})
        norm = {"revision": self.revision, "files": files}
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

    def _hash_served(self, rel):
        rel_dir, name = posixpath.split(rel)
        dir_fd = open_dir_beneath(self.root, posixpath.join("revisions", self.revision, rel_dir))
        try:
            with os.fdopen(open_nofollow(name, os.O_RDONLY, dir_fd=dir_fd), "rb", buffering=0) as fh:
                return hash_stream(fh, self.bufsize)[1][0]
        finally:
            os.close(dir_fd)

    def _history(self):
        try:
            with open(os.path.join(self.root, HISTORY_NAME), encoding="utf-8") as fh:
                h = json.load(fh)
            return [r for r in h if isinstance(r, str)] if isinstance(h, list) else []
        except (OSError, ValueError):
            return []

    def _prune_plan(self):
        """Revisions to delete: beyond the keep most recently served, not the served one and not named by any
        instance record. Also sets present (revisions on disk), in_use, kept_in_use and record_problems."""
        revs_dir = os.path.join(self.root, "revisions")
        self.in_use, self.record_problems = revisions_in_use(self.in_use_records, revs_dir)
        self.kept_in_use = []
        self.present = []
        if not os.path.isdir(revs_dir):
            return []
        present = [
            d for d in os.listdir(revs_dir) if os.path.isdir(os.path.join(revs_dir, d)) and not d.startswith(".")
        ]
        history = [self.revision] + [r for r in self._history() if r != self.revision]
        known = [self.revision] + [r for r in history[1:] if r in present]  # the new one counts before it exists
        unknown = sorted(
            (r for r in present if r not in history),
            key=lambda r: os.stat(os.path.join(revs_dir, r)).st_mtime,
            reverse=True,
        )
        self.present = sorted(present)
        beyond = [r for r in (known + unknown)[self.keep:] if r != self.revision]
        if self.record_problems:
            # Any revision may be what the unreadable record's instance runs: keep them all until it is fixed.
            return []
        self.kept_in_use = [r for r in beyond if r in self.in_use]
        return [r for r in beyond if r not in self.in_use]

    # ------------------------------------------------------------ apply

    def preflight(self):
        fs_path, free = free_bytes(self.root)
        need = self.fetch_bytes + self.margin if self.todo else 0
        if need > free:
            raise WeightsError(
                f"not enough disk space for revision {self.revision} under {self.root} (filesystem of {fs_path}): "
                f"need {_fmt_bytes(need)} ({_fmt_bytes(self.fetch_bytes)} still to fetch + "
                f"{_fmt_bytes(self.margin)} margin), free {_fmt_bytes(free)}, short by {_fmt_bytes(need - free)}; "
                "free space there or lower model_weights_keep"
            )

    def _own(self, path):
        if self.uid != -1 or self.gid != -1:
            os.chown(path, self.uid, self.gid)

    def _own_fd(self, fd):
        if self.uid != -1 or self.gid != -1:
            os.fchown(fd, self.uid, self.gid)

    def _tree_dir(self, rel):
        """Make root/rel (inside the module's own trees) without following any link below the root; returns its fd."""
        return open_dir_beneath(self.root, rel, create=True, on_create=self._own_fd)

    def _makedirs(self, path):
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
            self._own(d)

    def _fetch_one(self, entry):
        rel_dir, name = posixpath.split(entry["path"])
        part_name = name + PART_SUFFIX
        stage_fd = self._tree_dir(posixpath.join(".staging", self.revision, rel_dir))
        try:
            part = (fd_path(stage_fd, part_name) if self.proc_fds
                    else os.path.join(self.staging, entry["path"] + PART_SUFFIX))
            fetcher = self.fetcher()
            transferred = 0
            for attempt in (1, 2):
                transferred += fetcher.fetch(entry, part)
                good, size, sha256 = self._check_part(stage_fd, part_name, entry)
                if good:
                    break
                # A wrong prefix (earlier corrupt partial) or a bad transfer: start over from byte 0, once.
                try:
                    os.unlink(part_name, dir_fd=stage_fd)
                except FileNotFoundError:
                    pass
                if attempt == 2:
                    raise WeightsError(
                        f"{entry['path']} from {fetcher.describe()} does not match the manifest after a full "
                        f"re-fetch (size {size}, expected {entry['size']}); the source is corrupt"
                    )
            entry["sha256"] = sha256
            rev_fd = self._tree_dir(posixpath.join("revisions", self.revision, rel_dir))
            try:
                try:
                    st = os.lstat(name, dir_fd=rev_fd)
                except FileNotFoundError:
                    st = None
                if st is not None and stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(fd_path(rev_fd, name) if self.proc_fds else os.path.join(self.revdir, entry["path"]))
                # atomic, and relative to fds opened without following links: readers see the old file or the
                # verified new one, and the new one lands in the revision directory, nowhere else
                os.replace(part_name, name, src_dir_fd=stage_fd, dst_dir_fd=rev_fd)
            finally:
                os.close(rev_fd)
        finally:
            os.close(stage_fd)
        return transferred

    def _check_part(self, stage_fd, part_name, entry):
        """(good, size, sha256) of the staged .part, read through an O_NOFOLLOW fd; a good one is made 0644 and
        owned as configured through the same fd."""
        try:
            fd = open_nofollow(part_name, os.O_RDONLY, dir_fd=stage_fd)
        except FileNotFoundError:
            return False, -1, None
        with os.fdopen(fd, "rb", buffering=0) as fh:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry["size"]:
                return False, st.st_size, None
            algos = ("sha256",) if "sha256" in entry else ("sha256", "git_sha1")
            _, digests = hash_stream(fh, self.bufsize, algos, git_size=st.st_size)
            good = digests[0] == entry["sha256"] if "sha256" in entry else digests[1] == entry["git_sha1"]
            if good:
                os.fchmod(fd, 0o644)
                self._own_fd(fd)
            return good, st.st_size, digests[0]

    def apply(self):
        self._makedirs(self.root)
        lock_fd = open_nofollow(os.path.join(self.root, LOCK_NAME), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            import fcntl

            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise WeightsError(f"another model_weights run holds {self.root}/{LOCK_NAME}") from None
            return self._apply_locked()
        finally:
            os.close(lock_fd)

    def _apply_locked(self):
        changed = False
        transferred = 0
        os.close(self._tree_dir(f"revisions/{self.revision}"))
        if self.todo:
            os.close(self._tree_dir(f".staging/{self.revision}"))
            errors = []
            with ThreadPoolExecutor(max_workers=self.dl_workers) as ex:
                futures = [(f, ex.submit(self._fetch_one, f)) for f in self.todo]
                for f, fut in futures:
                    try:
                        transferred += fut.result()
                    except (ManifestError, WeightsError, OSError) as e:
                        errors.append(f"{f['path']}: {e}")
            if errors:
                raise WeightsError(
                    f"{len(errors)} of {len(self.todo)} files could not be fetched (what arrived is kept in "
                    f"{self.staging} and resumed next run): " + "; ".join(errors)
                )
            changed = True
        for rel in self.extra:
            rel_dir, name = posixpath.split(rel)
            dir_fd = open_dir_beneath(self.root, posixpath.join("revisions", self.revision, rel_dir))
            try:
                os.unlink(name, dir_fd=dir_fd)  # the entry itself, never what a link would point to
            finally:
                os.close(dir_fd)
            changed = True
        self._write_manifest()
        if os.path.isdir(self.staging):
            shutil.rmtree(self.staging)
        if not self.link_ok:
            self._makedirs(os.path.dirname(self.link))
            tmp = f"{self.link}.tmp-{os.getpid()}"
            if os.path.lexists(tmp):
                os.unlink(tmp)
            os.symlink(self.want_target, tmp)
            os.replace(tmp, self.link)
            changed = True
        history = [self.revision] + [r for r in self._history() if r != self.revision]
        # Planned before the lock and the fetch: read the records again, so one written meanwhile still counts.
        self.to_prune = self._prune_plan()
        for r in self.to_prune:
            shutil.rmtree(os.path.join(self.root, "revisions", r), ignore_errors=False)
            shutil.rmtree(os.path.join(self.root, ".staging", r), ignore_errors=True)
            changed = True
        history = [r for r in history if r not in self.to_prune]
        if history != self._history():
            write_atomic(os.path.join(self.root, HISTORY_NAME), json.dumps(history) + "\n")
        return changed, transferred

    # ------------------------------------------------------------ run

    def run(self):
        t0 = time.monotonic()
        self.validate()
        self.plan()
        if not self.check:
            self.preflight()
        result = dict(
            revision=self.revision,
            revision_path=self.revdir,
            link=self.link,
            previous_target=self.current_target,
            fetch_bytes=self.fetch_bytes if self.todo else 0,
            transferred_bytes=0,
            removed=self.extra,
            manifest_origin=self.origin,
        )
        if self.local_manifest_bad:
            self.module.warn(f"ignored the revision's own manifest ({self.local_manifest_bad}); used the source's")
        revisions_before = list(self.present)
        final = dict(self.states)
        if self.check:
            changed = bool(self.todo or self.extra or not self.link_ok or self.to_prune)
            try:
                self.preflight()
            except WeightsError as e:
                self.module.warn(f"check mode: the real run would fail the disk preflight: {e}")
        else:
            changed, transferred = self.apply()
            result["transferred_bytes"] = transferred
            for f in self.todo:
                final[f["path"]] = FETCHED if self.states[f["path"]] == MISSING else REPAIRED
        result.update(
            pruned=self.to_prune,
            kept_in_use=self.kept_in_use,
            in_use={r: paths for r, paths in sorted(self.in_use.items())},
            unreadable_records=self.record_problems,
        )
        if self.record_problems:
            self.module.warn(
                f"pruned no revision under {self.root}/revisions: {len(self.record_problems)} vLLM instance record(s) "
                "matching in_use_records could not be read, so any revision may still be in use: "
                + "; ".join(self.record_problems)
                + "; fix or remove the record (re-running the vllm_serve role rewrites it) and rerun"
            )
        result["files"] = [
            {"path": f["path"], "size": f["size"], "state": final[f["path"]]} for f in self.manifest["files"]
        ]
        summary = {}
        for s in final.values():
            summary[s] = summary.get(s, 0) + 1
        result["summary"] = summary
        result["elapsed_s"] = round(time.monotonic() - t0, 3)
        if not self.link_ok or self.to_prune or self.kept_in_use:
            revisions_after = sorted(r for r in set(revisions_before) | {self.revision} if r not in self.to_prune)
            after = {"link": self.link, "target": self.want_target, "revisions": revisions_after}
            if self.kept_in_use:
                after["kept_in_use"] = {r: self.in_use[r] for r in self.kept_in_use}
            result["diff"] = {
                "before": {"link": self.link, "target": self.current_target or "(absent)",
                           "revisions": revisions_before},
                "after": after,
            }
        result["changed"] = changed
        return result


def main():
    module = AnsibleModule(
        argument_spec=dict(
            root=dict(type="path", required=True),
            revision=dict(type="str", required=True),
            link=dict(type="path", required=True),
            source=dict(
                type="dict",
                required=True,
                options=dict(
                    type=dict(type="str", required=True, choices=["hf", "http", "path", "peer"]),
                    revision=dict(type="str"),
                    repo_id=dict(type="str"),
                    endpoint=dict(type="str", default="https://huggingface.co"),
                    url=dict(type="str"),
                    path=dict(type="path"),
                    host=dict(type="str"),
                    user=dict(type="str"),
                    port=dict(type="int"),
                    ssh_key=dict(type="path", no_log=False),
                    ssh_args=dict(type="list", elements="str", default=[]),
                ),
            ),
            token=dict(type="str", no_log=True),
            keep=dict(type="int", default=2),
            in_use_records=dict(type="list", elements="str", default=[]),
            verify=dict(type="str", default="full", choices=["full", "size"]),
            workers=dict(type="int", default=0),
            download_workers=dict(type="int", default=4),
            buffer_size_mib=dict(type="int", default=16),
            space_margin_mib=dict(type="int", default=1024),
            timeout=dict(type="int", default=60),
            retries=dict(type="int", default=3),
            owner=dict(type="str"),
            group=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    try:
        result = ModelWeights(module).run()
    except (WeightsError, ManifestError) as e:
        module.fail_json(msg=str(e))
    except OSError as e:
        # Last resort (the expected failures are named above): still a message naming the path, never a traceback.
        hint = "free space there and rerun" if e.errno == errno.ENOSPC else "check that path and rerun"
        module.fail_json(msg=f"model_weights: {e.strerror or e} on {e.filename or module.params['root']}; {hint}")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
