"""scripts/testhosts: `down`: stop the hosts and remove everything they used."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from .config import ENV_RE, ENVS, LINK_ALIAS_PREFIX, NETNS_PREFIX, TesthostsError, bridge_name, netns_name, veth_names
from .system import (
    all_envs,
    env_dir,
    link_exists,
    load_state,
    locked,
    mounted,
    netns_exists,
    nft_apply,
    nspawn_pids,
    pid_alive,
    pids_in_netns,
    run,
)

# ------------------------------------------------------------------------------------------------- down


def cleanup_host(env: str, host: str) -> None:
    """Stop the host's container and remove its mounts, netns, veth and per-host dirs. Safe to repeat."""
    hdir = env_dir(env) / host
    stop_pids(nspawn_pids(str(hdir / "root")))
    root = hdir / "root"
    # The netns of hosts made before 2026-12-03 15:00 was named pdth-<env>-<host>: clean those up too.
    namespaces = [netns_name(env, host), f"{NETNS_PREFIX}{env}-{host}"]
    for ns in namespaces:
        orphans = pids_in_netns(ns)
        if orphans:
            print(f"testhosts: env {env}: host {host}: killing {len(orphans)} orphaned process(es) in netns {ns}",
                  file=sys.stderr)
            kill_pids(orphans)
    if mounted(root):
        if run("umount", str(root), check=False).returncode != 0:
            run("umount", "-l", str(root))
    for ns in namespaces:
        if netns_exists(ns):
            run("ip", "netns", "delete", ns)
    # Deleting the netns deletes the veth pair asynchronously: delete what is still there, then wait.
    links = veth_names(env, host)
    for link in links:
        if link_exists(link):
            run("ip", "link", "delete", link, check=False)
    wait_until(lambda: not any(link_exists(link) for link in links), 5.0)
    for sub in ("upper", "work", "root"):
        if (hdir / sub).exists():
            shutil.rmtree(hdir / sub)


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def kill_pids(pids: list[int]) -> None:
    _signal(pids, signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(p) for p in pids), 5.0)


def stop_pids(pids: list[int], timeout: float = 20.0) -> None:
    """SIGTERM to systemd-nspawn makes it shut the container's systemd down cleanly; SIGKILL after timeout."""
    _signal(pids, signal.SIGTERM)
    if wait_until(lambda: not any(pid_alive(p) for p in pids), timeout):
        return
    left = [p for p in pids if pid_alive(p)]
    print(f"testhosts: systemd-nspawn pid(s) {left} did not stop in {timeout:.0f} s: SIGKILL", file=sys.stderr)
    kill_pids(left)


def leftovers(env: str) -> dict[str, list[str]]:
    """What of env still exists on the machine, found by names and aliases, not by the state file."""
    prefix = str(env_dir(env)) + "/"
    netns = sorted(p.name for p in Path("/run/netns").glob(f"{NETNS_PREFIX}{env}.*")) if Path(
        "/run/netns").exists() else []
    links = []
    for dev in Path("/sys/class/net").iterdir():
        try:
            alias = (dev / "ifalias").read_text().strip()
        except OSError:
            continue
        if alias == f"{LINK_ALIAS_PREFIX}{env}" or alias.startswith(f"{LINK_ALIAS_PREFIX}{env}:"):
            links.append(dev.name)
    if link_exists(bridge_name(env)) and bridge_name(env) not in links:
        links.append(bridge_name(env))
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if line.split()[4].startswith(prefix)]
    return {"processes": [str(p) for p in nspawn_pids(prefix)], "netns": netns, "links": sorted(links),
            "mounts": mounts}


def down_env(env: str) -> None:
    state = load_state(env) or {"hosts": {}}
    hosts = set(state["hosts"])
    if env_dir(env).exists():
        hosts |= {p.name for p in env_dir(env).iterdir() if p.is_dir()}
    stop_pids(nspawn_pids(str(env_dir(env)) + "/"))
    for host in sorted(hosts):
        cleanup_host(env, host)
    left = leftovers(env)
    for m in sorted(left["mounts"], key=len, reverse=True):
        run("umount", "-l", m, check=False)
    for ns in left["netns"]:
        run("ip", "netns", "delete", ns, check=False)
    for link in left["links"]:
        if link_exists(link):
            run("ip", "link", "delete", link, check=False)
    if env_dir(env).exists():
        shutil.rmtree(env_dir(env))
    nft_apply()
    left = leftovers(env)
    if any(left.values()):
        raise TesthostsError(f"env {env}: could not remove {json.dumps(left)}; docs/testhosts.md, troubleshooting")
    print(f"testhosts: env {env}: down, nothing left")


def envs_on_machine() -> set[str]:
    """Envs known by state dirs, plus any whose bridge/veth aliases or netns are still on the machine."""
    envs = set(all_envs())
    if ENVS.exists():
        envs |= {p.name for p in ENVS.iterdir() if p.is_dir()}
    for dev in Path("/sys/class/net").iterdir():
        with contextlib.suppress(OSError):
            alias = (dev / "ifalias").read_text().strip()
            if alias.startswith(LINK_ALIAS_PREFIX):
                envs.add(alias[len(LINK_ALIAS_PREFIX):].split(":")[0])
    return envs


def cmd_down(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        raise TesthostsError("needs root")
    with locked():
        envs = sorted(envs_on_machine()) if args.all else [args.env]
        for env in envs:
            if not ENV_RE.match(env):
                raise TesthostsError(f"--env '{env}': not a valid env name")
            down_env(env)
        if args.all:
            # Orphaned netns of ours whose env name could not be recovered from a link alias.
            if Path("/run/netns").exists():
                for ns in Path("/run/netns").glob(f"{NETNS_PREFIX}*"):
                    run("ip", "netns", "delete", ns.name, check=False)
            nft_apply()
        if not envs:
            print("testhosts: no env to take down")
    return 0
