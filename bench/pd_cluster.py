"""The cluster view for Python tools: the same plugins/module_utils/pd_cluster_view.py cluster_view() that
playbooks/validate.yml publishes as pd_cluster, fed from `ansible-inventory --list` (or from hostvars already read).

    from ansible_collections.b300.pd.bench.pd_cluster import load
    view = load("inventory/local")       # view["router_url"], view["instances"][0]["url"], view["prometheus_url"]
    ctx = ssl.create_default_context(cafile=view["router_ca_file"])  # the front door's CA (https), None: http

One code path: view_inputs() picks each host's own value of the vars the view reads, else the owning role's
default (roles/<role>/defaults/main.yml, plugins/plugin_utils/pd_role_defaults.py), exactly as the pd_topology
action plugin gathers them for validate.yml.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from ansible_collections.b300.pd.plugins.module_utils.pd_cluster_inputs import view_inventory  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_cluster_view import cluster_view, view_inputs  # noqa: E402
from ansible_collections.b300.pd.plugins.plugin_utils.pd_role_defaults import role_defaults  # noqa: E402

ANSIBLE_INVENTORY = ROOT / ".venv" / "bin" / "ansible-inventory"


def view_from(groups: dict, hostvars: dict) -> dict:
    """The view from groups (name -> hosts, inventory order) and hostvars (host -> vars, group vars merged)."""
    inv = view_inventory(groups, hostvars, role_defaults())  # what the pd_topology action plugin passes the module
    return cluster_view(*view_inputs(inv["groups"], inv["hostvars"], inv["defaults"]))


def inventory_data(inventory: str | Path) -> tuple[dict, dict]:
    """(groups, hostvars) of an inventory, from `ansible-inventory --list` (group vars merged into hostvars)."""
    exe = str(ANSIBLE_INVENTORY) if ANSIBLE_INVENTORY.exists() else "ansible-inventory"
    out = subprocess.run([exe, "-i", str(inventory), "--list"], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    data = json.loads(out)
    hostvars = data.get("_meta", {}).get("hostvars", {})
    # The front door's CA lives under pd_control_dir (the cluster view's router_ca_file): the shipped inventories set
    # it from inventory_dir, which `ansible-inventory --list` leaves untemplated.
    source = Path(inventory).resolve()
    inventory_dir = str(source if source.is_dir() else source.parent)
    for hv in hostvars.values():
        if isinstance(hv.get("pd_control_dir"), str):
            hv["pd_control_dir"] = re.sub(r"\{\{\s*inventory_dir\s*\}\}", inventory_dir, hv["pd_control_dir"])
            if "{{" in hv["pd_control_dir"]:
                del hv["pd_control_dir"]  # a template bench cannot evaluate: no CA path (the system's trust store)

    def members(group: str) -> list[str]:
        node = data.get(group) or {}
        hosts = list(node.get("hosts") or [])
        for child in node.get("children") or []:
            hosts += members(child)
        return list(dict.fromkeys(hosts))

    groups = {g: members(g) for g in ("all", "vllm_hosts", "router_hosts", "monitoring_hosts")}
    return groups, hostvars


def load(inventory: str | Path) -> dict:
    """The cluster view of an inventory directory or file."""
    return view_from(*inventory_data(inventory))


if __name__ == "__main__":  # python bench/pd_cluster.py inventory/local  -> the view as JSON
    print(json.dumps(load(sys.argv[1] if len(sys.argv) > 1 else ROOT / "inventory" / "local"), indent=2))
