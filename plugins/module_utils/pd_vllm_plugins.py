# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Fingerprints of the vLLM plugins a venv loads (entry point group vllm.general_plugins), for the instance record.

Reads the venv on this host; plugins/modules/vllm_instance.py puts the result in the record (pd_record.build_record).
"""

from __future__ import annotations

import configparser
import glob
import hashlib
import os

PLUGIN_GROUP = "vllm.general_plugins"


def plugin_digests(venv):
    """{entry point: sha256 (16 hex) of its module's source} of every vLLM plugin in the venv (entry point group
    vllm.general_plugins: vLLM imports each one in every process it starts, the bundle's own pd_* plugins among
    them). In the record, a change of plugin code restarts the instance through the change path as a change of
    its flags does; without it the engines ran the old code until their next restart. A package plugin is hashed
    by its __init__.py. {} where the venv is not on this host (a review render on the control node)."""
    out = {}
    for site in sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))):
        for ep_file in sorted(glob.glob(os.path.join(site, "*.dist-info", "entry_points.txt"))):
            parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
            parser.optionxform = str  # entry point names keep their case
            try:
                parser.read(ep_file, encoding="utf-8")
            except (OSError, UnicodeDecodeError, configparser.Error):
                continue  # not ours to judge: vLLM skips what it cannot load, so does the record
            if not parser.has_section(PLUGIN_GROUP):
                continue
            for name, target in parser.items(PLUGIN_GROUP):
                rel = target.split(":", 1)[0].strip().replace(".", "/")
                source = next((os.path.join(site, c) for c in (rel + ".py", rel + "/__init__.py")
                               if os.path.isfile(os.path.join(site, c))), None)
                if source is None:
                    out[name] = "missing"
                    continue
                with open(source, "rb") as fh:
                    out[name] = hashlib.sha256(fh.read()).hexdigest()[:16]
    return out
