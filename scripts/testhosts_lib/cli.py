"""scripts/testhosts: `status`, `ssh` and the command line."""

from __future__ import annotations

import argparse
import os
import sys

from . import __doc__ as package_doc
from .config import TesthostsError, ssh_argv
from .down import cmd_down
from .system import all_envs, load_state, print_env
from .up import cmd_up

# ------------------------------------------------------------------------------------------------- status / ssh


def cmd_status(_args: argparse.Namespace) -> int:
    envs = all_envs()
    if not envs:
        print("testhosts: no env is up")
    for env in envs:
        print_env(env)
    return 0


def cmd_ssh(args: argparse.Namespace) -> int:
    state = load_state(args.env)
    if not state or args.host not in state["hosts"]:
        known = ", ".join(state["hosts"]) if state else "none (env not up)"
        raise TesthostsError(f"env {args.env}: no host '{args.host}' (hosts: {known})")
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    argv = ssh_argv(state["hosts"][args.host]["ip"], batch=bool(cmd))
    if cmd:
        argv += ["--", *cmd]
    os.execvp("ssh", argv)  # noqa: S606 (argv list, no shell)
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/testhosts", description=package_doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start an env's hosts (idempotent) and wait for ssh")
    up.add_argument("--env", required=True)
    up.add_argument("--hosts", help="name=ip[,name=ip...], all in one /24 (default for --env local: inventory)")
    up.add_argument("--bind-ro", action="append", default=[], metavar="SRC:DST", help="read-only bind mount")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for sshd on every host")
    up.set_defaults(func=cmd_up)
    down = sub.add_parser("down", help="stop an env's hosts and remove everything they used")
    g = down.add_mutually_exclusive_group(required=True)
    g.add_argument("--env")
    g.add_argument("--all", action="store_true")
    down.set_defaults(func=cmd_down)
    st = sub.add_parser("status", help="envs, hosts, pids, ssh")
    st.set_defaults(func=cmd_status)
    ssh = sub.add_parser("ssh", help="ssh to a host as root with the test key")
    ssh.add_argument("--env", required=True)
    ssh.add_argument("host")
    ssh.add_argument("cmd", nargs=argparse.REMAINDER)
    ssh.set_defaults(func=cmd_ssh)
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except TesthostsError as e:
        print(f"testhosts: {e}", file=sys.stderr)
        return 1
