#!/usr/bin/python
# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# The module's documentation, arguments and main(); the work is in module_utils/weights_run.py and the model_* and
# weights_* files it uses (packed into the AnsiballZ payload by their imports).

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
  - With O(manifest) (the manifest pinned on the control node) that manifest is the only authority - neither the
    revision's own C(manifest.json) nor the source's (a peer's) is read for the file list - every file is checked
    against it, and a file the source delivers that differs from it is refused, naming the source (its host, see
    O(source.name)) and the file.
  - With O(pin) the module runs in pin mode on the control node - it returns the pinned manifest of the revision from
    the pin file, writing that file first when it does not exist (from O(manifest), the first verified download's,
    or else from a V(hf) or V(http) source's listing) - and touches nothing else.
version_added: "1.0.0"
author: b300-pd contributors (@b300-pd)
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
      name:
        description: Inventory name of the peer (V(peer)), named in messages (a file it holds that differs from the
          manifest is refused naming this host and the file).
        type: str
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
  manifest:
    description:
      - The manifest of O(revision) pinned on the control node (C(revision) and C(files), a list of C(path), C(size)
        and C(sha256) or, for a hub file outside LFS, C(git_sha1)). When set, it is what every file is checked
        against and what decides which files the revision holds.
      - In pin mode (O(pin)) the first verified download's manifest (this module's RV(manifest)) to pin when no pin
        file exists yet; when one exists, both must agree.
    type: dict
  pin:
    description:
      - Pin mode - the absolute path of the pin file on the host the module runs on (the control node,
        C(<model_weights_pin_dir>/<model>@<revision>.manifest.json)). Returns RV(manifest) from it, writing it when
        it does not exist (from O(manifest), else from a V(hf) or V(http) source); for a V(path) or V(peer) source
        with no pin and no O(manifest) returns a null RV(manifest). O(root) and O(link) are not touched; the result
        holds only RV(revision), RV(pin), RV(pinned) and RV(manifest).
    type: path
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

- name: Pin the revision's manifest on the control node (from the hub's listing, once)
  b300.pd.model_weights:
    root: /mnt/model/glm
    link: /mnt/model/glm/GLM-5.2-NVFP4
    revision: 0123456789abcdef0123456789abcdef01234567
    source:
      type: hf
      repo_id: zai-org/GLM-5.2-NVFP4
    pin: /home/ops/b300-pd/.cache/weights/zai-org--GLM-5.2-NVFP4@0123456789abcdef0123456789abcdef01234567.manifest.json
  delegate_to: localhost
  run_once: true
  become: false
  register: pinned

- name: Copy the revision from the first host, checking every byte against the pinned manifest
  b300.pd.model_weights:
    root: /mnt/model/glm
    link: /mnt/model/glm/GLM-5.2-NVFP4
    revision: 0123456789abcdef0123456789abcdef01234567
    manifest: "{{ pinned.manifest }}"
    source:
      type: peer
      name: b300-01
      host: 10.0.0.11
      user: root
      path: 0123456789abcdef0123456789abcdef01234567

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
  description: V(local) when the revision's own manifest.json was used, else the source description (and, with
    O(manifest), that the files were checked against the manifest pinned on the control node).
  returned: always
  type: str
pinned:
  description: Whether the files were checked against O(manifest) (in pin mode - whether the revision is pinned).
  returned: always
  type: bool
manifest:
  description: The revision's manifest as this host now holds it (with a sha256 for every file once written); in pin
    mode the pinned manifest, or null when nothing is pinned yet.
  returned: always
  type: dict
  sample: {"revision": "3f0c...e1", "files": [{"path": "config.json", "size": 64, "sha256": "9a1e..."}]}
pin:
  description: The pin file (pin mode).
  returned: when O(pin) is set
  type: str
"""

# Imports after the documentation (community.general layout).

import errno  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.model_errors import ManifestError, WeightsError  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.weights_run import ModelWeights  # noqa: E402


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
                    name=dict(type="str"),
                    host=dict(type="str"),
                    user=dict(type="str"),
                    port=dict(type="int"),
                    ssh_key=dict(type="path", no_log=False),
                    ssh_args=dict(type="list", elements="str", default=[]),
                ),
            ),
            token=dict(type="str", no_log=True),
            manifest=dict(type="dict"),
            pin=dict(type="path"),
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
