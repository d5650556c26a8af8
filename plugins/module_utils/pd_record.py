# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The record of one vLLM instance (<env_dir>/<name>.record.json): what its unit runs, machine-readable, with the
NIXL compatibility key that tells the router which prefill and decode instances can pair.

Pure functions, no I/O. Written by plugins/modules/vllm_instance.py beside the unit; read back by
plugins/modules/pd_instance_state.py (the change path reads records, never the unit text).
"""

from __future__ import annotations

import hashlib
import json
import posixpath

from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import DEFAULT_ENV_DIR, unit_name

# Flags whose value enters vLLM's NIXL compatibility hash (vllm/distributed/kv_transfer/kv_connector/v1/nixl/
# metadata.py): two instances that differ in one of them, or in the vLLM / NIXL version, refuse each other's
# handshake, so the router must never pair them (pd_rollout routing during a change).
COMPAT_FLAGS = (
    "model",
    "dtype",
    "kv-cache-dtype",
    "speculative-config",
    "attention-backend",
    "disable-hybrid-kv-cache-manager",
    "kv-transfer-config",
)
# JSON fields of compat flags that differ between a prefill and a decode instance by design and are not in vLLM's
# hash: the kv role and per-instance addresses, and the number of speculative tokens (the recipe runs MTP 1 on
# prefill, MTP 3 on decode; the hash takes the method and draft model only). Without dropping them no prefill
# instance would ever have the key of a decode instance.
_NOT_HASHED = {
    "kv-transfer-config": ("kv_role", "engine_id", "kv_rank", "kv_ip", "kv_port", "kv_parallel_size"),
    "speculative-config": ("num_speculative_tokens",),
}
RECORD_SCHEMA = 1
RECORD_SUFFIX = ".record.json"
ROLLBACK_DIR = "rollback"


def _hashed_part(flag, value):
    try:
        cfg = json.loads(value)
    except (TypeError, ValueError):
        return value
    if not isinstance(cfg, dict):
        return value
    return {k: v for k, v in cfg.items() if k not in _NOT_HASHED[flag]}


def _compat_values(argv):
    vals = {}
    for flag in COMPAT_FLAGS:
        opt = "--" + flag
        for i, word in enumerate(argv):
            if word == opt:
                nxt = argv[i + 1] if i + 1 < len(argv) else ""
                vals[flag] = True if nxt.startswith("--") or nxt == "" else nxt
            elif word.startswith(opt + "="):
                vals[flag] = word.split("=", 1)[1]
    # `vllm serve <model>`: the positional model is the model (it wins over --model in ServeSubcommand.cmd()).
    if argv and not argv[0].startswith("-"):
        vals["model"] = argv[0]
    for flag in _NOT_HASHED:
        if flag in vals:
            vals[flag] = _hashed_part(flag, vals[flag])
    return vals


def compat_key(argv, vllm_version, nixl_version):
    """'vllm=<v>;nixl=<v>;flags=<sha256[:12]>' of the argv after `serve` (model first)."""
    blob = json.dumps(_compat_values(list(argv or [])), sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return f"vllm={vllm_version or 'unknown'};nixl={nixl_version or 'none'};flags={digest}"


def model_revision(model_path):
    """The revision a model path pins: its basename when it lies in a `revisions/` directory (model_weights)."""
    parent = posixpath.basename(posixpath.dirname(model_path.rstrip("/")))
    return posixpath.basename(model_path.rstrip("/")) if parent == "revisions" else None


def build_record(instance, *, python, command, argv, servers, vllm_version, nixl_version, plugins=None,
                 api_key_digest=None):
    """What the unit on disk runs, machine-readable: the change path reads this, never the unit text.

    api_key_digest: pd_recipe.api_key_digest of the workers' key the unit loads (None: no key); a key change
    changes the record and so restarts the instance through the drain path. Never the key itself.
    """
    record = {
        "schema": RECORD_SCHEMA,
        "instance": instance["name"],
        "pool": instance.get("pool"),
        "unit": unit_name(instance),
        "python": python,
        "venv": posixpath.dirname(posixpath.dirname(python)),
        "command": list(command),
        "argv": list(argv),
        "model_path": argv[0],
        "model_revision": model_revision(argv[0]),
        "vllm_version": vllm_version,
        "nixl_version": nixl_version,
        "compat_key": compat_key(argv, vllm_version, nixl_version),
        "api_server_count": servers,
        "plugins": dict(plugins or {}),
    }
    if api_key_digest:
        record["api_key_digest"] = api_key_digest
    return record


def render_record(record):
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def record_path(instance, env_dir=DEFAULT_ENV_DIR):
    return posixpath.join(env_dir, instance["name"] + RECORD_SUFFIX)


def pending_marker(env_dir, name):
    """The marker vllm_instance leaves until the caller has restarted the instance into its new files."""
    return posixpath.join(env_dir, f".{name}.restart-pending")


def running_record_path(env_dir, name, pending):
    """The record of what instance `name` runs now: the one vllm_instance saved under rollback/ while a restart is
    pending (the files changed, the process not restarted into them yet), else the record beside the unit."""
    if pending:
        return posixpath.join(env_dir, ROLLBACK_DIR, name + RECORD_SUFFIX)
    return posixpath.join(env_dir, name + RECORD_SUFFIX)


def parse_record(text):
    """A record's dict, or None for no text / not a JSON object (a damaged record is as good as none)."""
    try:
        record = json.loads(text) if text else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
