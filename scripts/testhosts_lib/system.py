"""scripts/testhosts: System helpers, an env's state file, the nftables table and the apt proxy."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import time
from pathlib import Path

from .config import APT_PROXY_PORT, CACHE, ENVS, LOCK, NFT_TABLE, TesthostsError

# ---------------------------------------------------------------------------------------------- system helpers


def run(*cmd: str, check: bool = True, netns: str | None = None, capture: bool = False) -> subprocess.CompletedProcess:
    argv = ["ip", "netns", "exec", netns, *cmd] if netns else list(cmd)
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and p.returncode != 0:
        raise TesthostsError(f"`{' '.join(argv)}` failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def nspawn_pids(directory_prefix: str) -> list[int]:
    """systemd-nspawn processes whose --directory is under directory_prefix (found by /proc, not by a pidfile)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"systemd-nspawn"):
            continue
        for a in argv:
            if a.startswith(b"--directory=") and a[len(b"--directory="):].decode(errors="replace").startswith(
                directory_prefix
            ):
                pids.append(int(d.name))
    return pids


def pids_in_netns(ns: str) -> list[int]:
    """Processes in netns ns: a container whose systemd-nspawn was SIGKILLed keeps running there, orphaned."""
    try:
        st = os.stat(f"/run/netns/{ns}")
    except OSError:
        return []
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                nst = os.stat(d / "ns" / "net")
                if (nst.st_dev, nst.st_ino) == (st.st_dev, st.st_ino):
                    pids.append(int(d.name))
    return pids


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive: it has to be reaped by its parent, which is not us after setsid.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def tcp_open(ip: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def locked():
    """One mutation of bridges/netns/nftables at a time (several engineers and scenarios share the machine)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ------------------------------------------------------------------------------------------------- state


def env_dir(env: str) -> Path:
    return ENVS / env


def load_state(env: str) -> dict | None:
    p = env_dir(env) / "state.json"
    if not p.exists():
        return None
    return json.loads(p.read_text())


def save_state(env: str, state: dict) -> None:
    p = env_dir(env) / "state.json"
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    tmp.replace(p)


def all_envs() -> list[str]:
    return sorted(p.name for p in ENVS.iterdir() if (p / "state.json").exists()) if ENVS.exists() else []


def host_running(env: str, host: str) -> int | None:
    """The pid of the host's systemd-nspawn when it is running, else None."""
    pids = [p for p in nspawn_pids(str(env_dir(env) / host / "root")) if pid_alive(p)]
    return pids[0] if pids else None


# ------------------------------------------------------------------------------------------------- nftables


def nft_ruleset(bridges: list[str]) -> str:
    """The whole pd_testhosts table for the given env bridges ('' when there is none: the table is deleted)."""
    head = f"table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\n"
    if not bridges:
        return head
    fwd, inp = [], []
    for br in sorted(bridges):
        # Routed traffic may neither leave an env's bridge nor enter it from elsewhere (other envs included).
        fwd.append(f'    iifname "{br}" oifname != "{br}" counter drop')
        fwd.append(f'    oifname "{br}" iifname != "{br}" counter drop')
        # The control node answers its own connections (ssh, http probes) and serves the apt proxy; no more.
        inp.append(f'    iifname "{br}" ct state established,related accept')
        inp.append(f'    iifname "{br}" tcp dport {APT_PROXY_PORT} accept')
        inp.append(f'    iifname "{br}" counter drop')
    return (
        head
        + f"table inet {NFT_TABLE} {{\n"
        + "  chain forward {\n    type filter hook forward priority -10; policy accept;\n"
        + "\n".join(fwd)
        + "\n  }\n  chain input {\n    type filter hook input priority -10; policy accept;\n"
        + "\n".join(inp)
        + "\n  }\n}\n"
    )


def nft_apply() -> None:
    bridges = [s["bridge"] for e in all_envs() if (s := load_state(e)) and link_exists(s["bridge"])]
    p = subprocess.run(["nft", "-f", "-"], input=nft_ruleset(bridges), capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise TesthostsError(f"nft: loading table inet {NFT_TABLE} failed: {p.stderr.strip()}")


# ------------------------------------------------------------------------------------------------- apt proxy


def ensure_apt_proxy() -> None:
    """apt-cacher-ng must listen on the control node (without systemd as PID 1 nothing starts it)."""
    if tcp_open("127.0.0.1", APT_PROXY_PORT):
        return
    init = Path("/etc/init.d/apt-cacher-ng")
    if not init.exists():
        raise TesthostsError(
            f"apt-cacher-ng is not installed (port {APT_PROXY_PORT} closed): scripts/bootstrap installs it"
        )
    if Path("/run/systemd/system").exists():
        run("systemctl", "start", "apt-cacher-ng")
    else:
        run(str(init), "start")
    for _attempt in range(20):
        if tcp_open("127.0.0.1", APT_PROXY_PORT):
            print(f"testhosts: started apt-cacher-ng (port {APT_PROXY_PORT})")
            return
        time.sleep(0.5)
    raise TesthostsError(f"apt-cacher-ng did not come up on port {APT_PROXY_PORT}: see /var/log/apt-cacher-ng/")


# ------------------------------------------------------------------------------------------------- status


def print_env(env: str) -> None:
    state = load_state(env)
    if not state:
        print(f"env {env}: not up")
        return
    print(f"env {env}: bridge {state['bridge']} ({'up' if link_exists(state['bridge']) else 'MISSING'}), "
          f"subnet {state['subnet']}, gateway/apt proxy {state['gateway']}:{APT_PROXY_PORT}")
    for host, h in state["hosts"].items():
        pid = host_running(env, host)
        ssh = "ssh ok" if pid and tcp_open(h["ip"], 22, 0.5) else "no ssh"
        print(f"  {host:<20} {h['ip']:<15} {'running pid ' + str(pid) if pid else 'STOPPED':<18} {ssh}  "
              f"netns {h['netns']}")
    for src, dst in state.get("binds", []):
        print(f"  bind-ro {src} -> {dst}")
    for dst, size in state.get("volumes", []):
        print(f"  volume {dst} (tmpfs, {size})")
