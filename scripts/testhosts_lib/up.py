"""scripts/testhosts: `up`: bridge, netns, veth, overlay root and systemd-nspawn per host, then ssh."""

from __future__ import annotations

import argparse
import ipaddress
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .config import (
    APT_PROXY_PORT,
    ENV_RE,
    ENVS,
    IMAGE,
    KEY,
    LINK_ALIAS_PREFIX,
    ROOT,
    SHM_SIZE,
    STAMP,
    TesthostsError,
    bridge_name,
    check_hosts,
    env_config_local,
    machine_name,
    netns_name,
    parse_bind,
    parse_hosts,
    ssh_argv,
    veth_names,
)
from .down import cleanup_host
from .system import (
    ensure_apt_proxy,
    env_dir,
    host_running,
    link_exists,
    load_state,
    locked,
    nft_apply,
    print_env,
    run,
    save_state,
    tcp_open,
)

# ------------------------------------------------------------------------------------------------- up


def memlock_warning() -> str | None:
    """A warning when this machine cannot give the containers an unlimited RLIMIT_MEMLOCK (no CAP_SYS_RESOURCE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if hard == resource.RLIM_INFINITY:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, resource.RLIM_INFINITY))
    except (ValueError, OSError):
        return (f"warning: this control node cannot raise RLIMIT_MEMLOCK above {hard} bytes (no CAP_SYS_RESOURCE); "
                "inside the test hosts LimitMEMLOCK=infinity is clamped to that (units still start; "
                "CAP_IPC_LOCK is granted instead). See docs/testhosts.md.")
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
    return None


def preflight() -> None:
    if os.geteuid() != 0:
        raise TesthostsError("needs root (bridges, netns, overlay mounts, systemd-nspawn)")
    for tool in ("ip", "nft", "systemd-nspawn", "ssh", "mount", "umount"):
        if not shutil.which(tool):
            raise TesthostsError(f"'{tool}' not found: run scripts/bootstrap (installs systemd-container, nftables)")
    if not STAMP.exists() or not (IMAGE / "lib/systemd/systemd").exists() or not KEY.exists():
        raise TesthostsError(f"no test-host image at {IMAGE}: run scripts/bootstrap (stage 30-testhosts-image)")


def subnet_in_use_elsewhere(net: ipaddress.IPv4Network, bridge: str) -> str | None:
    out = run("ip", "-4", "-o", "addr", "show").stdout
    for line in out.splitlines():
        f = line.split()
        dev, cidr = f[1], f[3]
        if dev != bridge and ipaddress.IPv4Interface(cidr).network.overlaps(net):
            return f"{dev} ({cidr})"
    return None


def ensure_bridge(bridge: str, gw: str, net: ipaddress.IPv4Network, env: str) -> None:
    if not link_exists(bridge):
        run("ip", "link", "add", "name", bridge, "type", "bridge")
        run("ip", "link", "set", bridge, "alias", f"{LINK_ALIAS_PREFIX}{env}")
    have = run("ip", "-4", "-o", "addr", "show", "dev", bridge).stdout
    if f" {gw}/{net.prefixlen} " not in have:
        run("ip", "addr", "add", f"{gw}/{net.prefixlen}", "dev", bridge)
    run("ip", "link", "set", bridge, "up")


def write_host_files(root: Path, host: str, hosts: dict[str, str], gw: str) -> None:
    """Per-host files written into the overlay before boot: hostname, /etc/hosts of the env, apt proxy."""
    etc = root / "etc"
    (etc / "hostname").write_text(f"{host}\n")
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback", f"{gw} testhosts-gateway"]
    lines += [f"{ip} {name}" for name, ip in hosts.items()]
    (etc / "hosts").write_text("\n".join(lines) + "\n")
    (etc / "apt/apt.conf.d/01testhosts-proxy").write_text(
        "// scripts/testhosts: the control node's apt-cacher-ng on this env's gateway; hosts have no other way out.\n"
        f'Acquire::http::Proxy "http://{gw}:{APT_PROXY_PORT}";\n'
    )


def start_host(env: str, host: str, *, ip: str, hosts: dict[str, str], net: ipaddress.IPv4Network,
               bridge: str, binds: list[tuple[Path, str]], volumes: list[tuple[str, str]] = ()) -> int:
    hdir = env_dir(env) / host
    cleanup_host(env, host)  # a host that is not running starts from a clean slate
    upper, work, root = hdir / "upper", hdir / "work", hdir / "root"
    for d in (upper, work, root):
        d.mkdir(parents=True, exist_ok=True)
    run("mount", "-t", "overlay", "overlay", "-o", f"lowerdir={IMAGE},upperdir={upper},workdir={work}", str(root))
    gw = str(net.network_address + 1)
    write_host_files(root, host, hosts, gw)

    ns = netns_name(env, host)
    vh, vp = veth_names(env, host)
    run("ip", "netns", "add", ns)
    run("ip", "link", "add", vh, "type", "veth", "peer", "name", vp)
    run("ip", "link", "set", vh, "alias", f"{LINK_ALIAS_PREFIX}{env}:{host}")
    run("ip", "link", "set", vp, "netns", ns)
    run("ip", "link", "set", vh, "master", bridge, "up")
    run("ip", "link", "set", vp, "name", "eth0", netns=ns)
    run("ip", "addr", "add", f"{ip}/{net.prefixlen}", "dev", "eth0", netns=ns)
    run("ip", "link", "set", "eth0", "up", netns=ns)
    run("ip", "link", "set", "lo", "up", netns=ns)
    run("ip", "route", "add", "default", "via", gw, netns=ns)

    argv = [
        "systemd-nspawn", "--quiet", "--boot",
        f"--directory={root}",
        f"--machine={machine_name(env, host)}",
        f"--hostname={host}",
        f"--network-namespace-path=/run/netns/{ns}",
        "--register=no", "--keep-unit",  # no systemd-machined/PID 1 on the control node to talk to
        "--resolv-conf=off",  # no DNS inside: names of the env come from /etc/hosts
        "--timezone=off",
        "--link-journal=no",
        "--console=pipe",
        "--rlimit=RLIMIT_MEMLOCK=infinity",  # vLLM/NIXL units set LimitMEMLOCK=infinity inside
        "--capability=CAP_IPC_LOCK",  # mlock beyond RLIMIT_MEMLOCK where the control node cannot raise it
        "--capability=CAP_NET_ADMIN",  # nftables inside the host's own netns (pd_firewall); not the control node's
        "--rlimit=RLIMIT_NOFILE=1048576",
        f"--tmpfs=/dev/shm:mode=1777,size={SHM_SIZE}",
    ]
    argv += [f"--bind-ro={src}:{dst}" for src, dst in binds]
    # A volume is its own filesystem of a fixed size (a server's model disk): filling it fails writes there only.
    argv += [f"--tmpfs={dst}:mode=0755,size={size}" for dst, size in volumes]
    log = (hdir / "nspawn.log").open("ab")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, close_fds=True)
    log.close()
    return proc.pid


def wait_ssh(env: str, hosts: dict[str, str], timeout: float) -> None:
    pending = dict(hosts)
    deadline = time.monotonic() + timeout
    missing: dict[str, int] = {}
    while pending:
        for host, ip in list(pending.items()):
            # Seen right after start: a running systemd-nspawn not found in /proc for one look (then found).
            # Only a host missing from 4 looks in a row (~2 s) has exited.
            missing[host] = 0 if host_running(env, host) else missing.get(host, 0) + 1
            if missing[host] >= 4:
                log = env_dir(env) / host / "nspawn.log"
                tail = log.read_text(errors="replace").splitlines()[-25:] if log.exists() else []
                raise TesthostsError(f"env {env}: host {host}: systemd-nspawn exited; last lines of {log}:\n"
                                     + "\n".join(tail))
            if tcp_open(ip, 22):
                p = subprocess.run([*ssh_argv(ip), "true"],
                                   capture_output=True, text=True, check=False)
                if p.returncode == 0:
                    del pending[host]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TesthostsError(
                f"env {env}: sshd did not answer within {timeout:.0f} s on "
                + ", ".join(f"{h} ({ip})" for h, ip in pending.items())
                + f"; see {env_dir(env)}/<host>/nspawn.log and `scripts/testhosts ssh --env {env} HOST`"
            )
        time.sleep(0.5)


def cmd_up(args: argparse.Namespace) -> int:
    env = args.env
    if not ENV_RE.match(env):
        raise TesthostsError(f"--env '{env}': use lowercase letters, digits, '-' and '_' (max 40)")
    binds_spec: list[tuple[str, str]] = []
    volumes: list[tuple[str, str]] = []
    if args.hosts:
        hosts = parse_hosts(args.hosts)
    elif env == "local":
        hosts, binds_spec, volumes = env_config_local()
    else:
        raise TesthostsError(f"--env {env}: give --hosts name=ip[,...] (only --env local reads them from inventory)")
    binds_spec += [parse_bind(b) for b in args.bind_ro]
    net = check_hosts(hosts)
    gw = str(net.network_address + 1)
    bridge = bridge_name(env)
    binds: list[tuple[Path, str]] = []
    for src, dst in binds_spec:
        p = Path(src) if Path(src).is_absolute() else ROOT / src
        binds.append((p, dst))
    preflight()

    t0 = time.monotonic()
    started, kept = [], []
    with locked():
        ENVS.mkdir(parents=True, exist_ok=True)
        state = load_state(env)
        if state:
            running = {h for h in state["hosts"] if host_running(env, h)}
            for h in running:
                if h in hosts and state["hosts"][h]["ip"] != hosts[h]:
                    raise TesthostsError(f"env {env}: host {h} runs with {state['hosts'][h]['ip']}, asked for "
                                         f"{hosts[h]}: run `scripts/testhosts down --env {env}` first")
            if running and state["subnet"] != str(net):
                raise TesthostsError(f"env {env} runs on {state['subnet']}, asked for {net}: down it first")
            extra = running - set(hosts)
            if extra:
                raise TesthostsError(f"env {env}: running host(s) {', '.join(sorted(extra))} are not in the "
                                     f"requested set: run `scripts/testhosts down --env {env}` first")
        clash = subnet_in_use_elsewhere(net, bridge)
        if clash:
            raise TesthostsError(f"env {env}: subnet {net} is already on {clash}: pick another /24 "
                                 "(docs/testhosts.md lists the allocation) or down the env that holds it")
        ensure_apt_proxy()
        env_dir(env).mkdir(parents=True, exist_ok=True)
        state = {"env": env, "bridge": bridge, "subnet": str(net), "gateway": gw,
                 "hosts": {h: {"ip": ip, "netns": netns_name(env, h), "veth": veth_names(env, h)[0],
                               "machine": machine_name(env, h)} for h, ip in hosts.items()},
                 "binds": [[str(s), d] for s, d in binds], "volumes": [[d, z] for d, z in volumes]}
        save_state(env, state)  # before any change: `down` finds whatever a failed `up` leaves
        ensure_bridge(bridge, gw, net, env)
        nft_apply()
        for src, _dst in binds:
            src.mkdir(parents=True, exist_ok=True)
        for host, ip in hosts.items():
            if host_running(env, host):
                kept.append(host)
                continue
            try:
                start_host(env, host, ip=ip, hosts=hosts, net=net, bridge=bridge, binds=binds, volumes=volumes)
            except TesthostsError as e:
                raise TesthostsError(f"env {env}: host {host}: {e}\n(what was made is recorded: "
                                     f"`scripts/testhosts down --env {env}` removes it)") from e
            started.append(host)
    wait_ssh(env, hosts, args.timeout)
    if started and (warning := memlock_warning()):
        print(f"testhosts: {warning}", file=sys.stderr)
    print(f"testhosts: env {env}: started {len(started)}, already running {len(kept)}, "
          f"all answer ssh ({time.monotonic() - t0:.1f} s)")
    print_env(env)
    return 0
