"""scripts/testhosts: Names, host specs and the inventory's test-host settings: pure, no system call."""

from __future__ import annotations

import hashlib
import ipaddress
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the clone: scripts/testhosts_lib/config.py
CACHE = ROOT / ".cache" / "testhosts"
IMAGE = CACHE / "image"
STAMP = CACHE / "image.stamp"
KEY = CACHE / "id_ed25519"
ENVS = CACHE / "envs"
LOCK = CACHE / ".lock"
NFT_TABLE = "pd_testhosts"
APT_PROXY_PORT = 3142
NETNS_PREFIX = "pdth-"
LINK_ALIAS_PREFIX = "pdth:"
SSH_OPTIONS = ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR", "IdentitiesOnly=yes",
               "ConnectTimeout=5"]


def ssh_argv(ip: str, batch: bool = True) -> list[str]:
    opts = SSH_OPTIONS + (["BatchMode=yes"] if batch else [])
    return ["ssh", "-i", str(KEY), *(x for o in opts for x in ("-o", o)), f"root@{ip}"]


ENV_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
HOST_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# /dev/shm inside: vLLM's CPU engine and NIXL/UCX (shared-memory transport) need far more than nspawn's default.
SHM_SIZE = "50%"
SIZE_RE = re.compile(r"^[1-9][0-9]*[KMG]$")


class TesthostsError(Exception):
    """A failure with a message for the person at the terminal (printed without a traceback)."""


def _hash(*parts: str) -> str:
    return hashlib.sha1("/".join(parts).encode(), usedforsecurity=False).hexdigest()


def bridge_name(env: str) -> str:
    """pdbr-<env> when it fits the kernel's 15-character limit, else pdbr-<10 hex of a hash of env>."""
    name = f"pdbr-{env}"
    return name if len(name) <= 15 else f"pdbr-{_hash(env)[:10]}"


def veth_names(env: str, host: str) -> tuple[str, str]:
    """(bridge side, host side before it is renamed eth0 inside the netns): 13 chars each."""
    h = _hash(env, host)[:11]
    return f"pv{h}", f"pp{h}"


def netns_name(env: str, host: str) -> str:
    """pdth-<env>.<host>: '.' is in neither env nor host names, so one env's netns never match another's."""
    return f"{NETNS_PREFIX}{env}.{host}"


def machine_name(env: str, host: str) -> str:
    return re.sub(r"[^a-zA-Z0-9-]", "-", f"pd-{env}-{host}")


def parse_hosts(spec: str) -> dict[str, str]:
    """'a=10.0.0.11,b=10.0.0.12' -> {'a': '10.0.0.11', 'b': '10.0.0.12'} (validated by check_hosts)."""
    hosts: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, ip = item.partition("=")
        if not sep or not name or not ip:
            raise TesthostsError(f"--hosts: '{item}' is not name=ip (example: --hosts h1=10.238.1.11,h2=10.238.1.12)")
        if name in hosts:
            raise TesthostsError(f"--hosts: host '{name}' given twice")
        hosts[name] = ip.strip()
    if not hosts:
        raise TesthostsError("--hosts: no host given")
    return hosts


def check_hosts(hosts: dict[str, str]) -> ipaddress.IPv4Network:
    """All hosts in one /24, none on .0/.1/.255, no address twice. Returns the /24."""
    nets = set()
    seen: dict[str, str] = {}
    for name, ip in hosts.items():
        if not HOST_RE.match(name):
            raise TesthostsError(f"host '{name}': not a valid hostname (lowercase letters, digits, '-'; fix the name)")
        try:
            addr = ipaddress.IPv4Address(ip)
        except ValueError as e:
            raise TesthostsError(f"host '{name}': address '{ip}' is not an IPv4 address") from e
        if not addr.is_private:
            raise TesthostsError(f"host '{name}': address {ip} is not private (use 10.x, 172.16-31.x or 192.168.x)")
        net = ipaddress.IPv4Network(f"{ip}/24", strict=False)
        if int(addr) - int(net.network_address) in (0, 1, 255):
            raise TesthostsError(f"host '{name}': {ip} is the network, gateway (.1) or broadcast address of {net}")
        if ip in seen:
            raise TesthostsError(f"hosts '{seen[ip]}' and '{name}' both have address {ip}")
        seen[ip] = name
        nets.add(net)
    if len(nets) != 1:
        raise TesthostsError(f"hosts of one env must share one /24; got {', '.join(sorted(map(str, nets)))}")
    return nets.pop()


def _load_yaml(path: Path):
    import yaml

    with path.open() as f:
        return yaml.safe_load(f) or {}


def inventory_hosts(data) -> dict[str, str]:
    """Every host with an ansible_host in a YAML inventory tree (groups, children, hosts), in file order."""
    found: dict[str, str] = {}

    def walk(group) -> None:
        if not isinstance(group, dict):
            return
        for name, hvars in (group.get("hosts") or {}).items():
            if isinstance(hvars, dict) and hvars.get("ansible_host"):
                found.setdefault(name, str(hvars["ansible_host"]))
        for child in (group.get("children") or {}).values():
            walk(child)

    for top in (data or {}).values():
        walk(top)
    return found


def env_config_local() -> tuple[dict[str, str], list[tuple[str, str]], list[tuple[str, str]]]:
    """Hosts from inventory/local/hosts.yml; bind mounts and size-limited volumes from inventory/local/testhosts.yml."""
    inv = ROOT / "inventory" / "local"
    hosts = inventory_hosts(_load_yaml(inv / "hosts.yml"))
    if not hosts:
        raise TesthostsError(f"{inv / 'hosts.yml'}: no host with an ansible_host")
    cfg_vars = ((_load_yaml(inv / "testhosts.yml").get("local") or {}).get("vars") or {})
    binds = []
    for i, b in enumerate(cfg_vars.get("pd_testhosts_bind_ro") or []):
        if not isinstance(b, dict) or not b.get("src") or not b.get("dest"):
            raise TesthostsError(f"{inv / 'testhosts.yml'}: pd_testhosts_bind_ro[{i}] needs 'src' and 'dest'")
        binds.append((str(b["src"]), str(b["dest"])))
    volumes = []
    for i, v in enumerate(cfg_vars.get("pd_testhosts_volumes") or []):
        if not isinstance(v, dict) or not str(v.get("dest", "")).startswith("/") or not SIZE_RE.match(
                str(v.get("size", ""))):
            raise TesthostsError(f"{inv / 'testhosts.yml'}: pd_testhosts_volumes[{i}] needs an absolute 'dest' and "
                                 "a 'size' like 256M or 1G")
        volumes.append((str(v["dest"]), str(v["size"])))
    return hosts, binds, volumes


def parse_bind(spec: str) -> tuple[str, str]:
    src, sep, dst = spec.partition(":")
    if not sep or not src or not dst.startswith("/"):
        raise TesthostsError(f"--bind-ro '{spec}': use SRC:DST with an absolute DST (example: .cache/x:/srv/x)")
    return src, dst
