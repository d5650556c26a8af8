# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Remember argvs a vLLM venv's own parser accepted, so the same argv is not parsed again by the same venv.

Importing vLLM to parse takes about a minute on a loaded node; a re-run of site.yml parses the same argvs with the
same venv. A key covers the interpreter, a fingerprint of its venv (any pip change misses) and the argvs; only
accepted argvs are ever recorded, so a rejection always runs the parser. Used by
plugins/modules/vllm_instance.py (on each host, through plugins/module_utils/pd_instance_check.py) and
plugins/modules/pd_vllm_argv_check.py (validate.yml, on the control node).
"""

from __future__ import annotations

import hashlib
import json
import os

from ansible_collections.b300.pd.plugins.module_utils.pd_files import atomic_write

CACHE_MAX = 256


def venv_fingerprint(python):
    """What changes whenever pip changes the venv of `python`: site-packages' mtime and its dist-info names."""
    venv = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(python))))
    parts = [venv]
    lib = os.path.join(venv, "lib")
    for pyver in sorted(os.listdir(lib)) if os.path.isdir(lib) else []:
        sp = os.path.join(lib, pyver, "site-packages")
        if os.path.isdir(sp):
            parts.append(f"{sp}:{os.stat(sp).st_mtime_ns}")
            parts.extend(sorted(n for n in os.listdir(sp) if n.endswith(".dist-info")))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def cache_key(python, payload):
    blob = json.dumps([os.path.abspath(python), venv_fingerprint(python), payload], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def read_cache(path):
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or damaged: parse again and rewrite it


def write_cache(path, entries, keep=CACHE_MAX):
    """Write the newest `keep` entries (by their "at") atomically, 0644."""
    newest = sorted(entries.items(), key=lambda kv: kv[1].get("at", 0))[-keep:]
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    atomic_write(path, json.dumps(dict(newest), sort_keys=True, indent=1) + "\n", 0o644)
