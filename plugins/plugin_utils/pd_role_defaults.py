# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The roles' defaults the cluster view falls back to, read on the control node: one reader for the pd_topology
action plugin (the playbook's pd_cluster) and bench/pd_cluster.py (bench's), so the two views cannot differ."""

from __future__ import annotations

from pathlib import Path

import yaml
from ansible_collections.b300.pd.plugins.module_utils.pd_cluster_inputs import VIEW_ROLES

# The collection root (this file is plugins/plugin_utils/pd_role_defaults.py): its roles own the defaults.
ROLES_DIR = Path(__file__).resolve().parents[2] / "roles"


def role_defaults(roles_dir=ROLES_DIR):
    """role -> its defaults/main.yml (unrendered, as the roles define them), for every role a view var belongs to."""
    return {role: yaml.safe_load((roles_dir / role / "defaults" / "main.yml").read_text()) or {}
            for role in VIEW_ROLES}
