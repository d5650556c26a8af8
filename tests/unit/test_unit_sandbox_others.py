"""Every other unit the bundle starts is sandboxed: `systemd-analyze security --offline=yes` scores <= 2.5.

The bundle's own units (the front door's mtail, the vLLM RSS collector) carry their sandbox; the units of
distribution packages (nginx, Prometheus, Alertmanager, node exporter) and pd-firewall get a drop-in
`/etc/systemd/system/<unit>.d/50-b300-pd-sandbox.conf`. Each file is rendered by ansible from the role's real template
(for the drop-ins: at the path the role's tasks/sandbox.yml writes it to) with the embedded default's inventory,
laid out in a root tree next to the distribution's unit file, and scored with `--root` so the drop-in is applied as
systemd applies it. main had no drop-in (nginx 9.6, Prometheus 4.0, Alertmanager and node exporter 9.2,
pd-firewall 9.6), and its mtail and RSS collector units scored 7.0 and 9.6.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MAX_EXPOSURE = 2.5
DROPIN = "50-b300-pd-sandbox.conf"
DIST_UNITS = Path("/lib/systemd/system")
# Debian bookworm's prometheus-node-exporter 1.5.0-1+b6 unit, for machines without the package (the control node
# does not install it): the drop-in is scored on top of the same text the hosts get.
DEBIAN_NODE_EXPORTER_UNIT = textwrap.dedent("""\
    [Unit]
    Description=Prometheus exporter for machine metrics
    Documentation=https://github.com/prometheus/node_exporter

    [Service]
    Restart=on-failure
    User=prometheus
    EnvironmentFile=/etc/default/prometheus-node-exporter
    ExecStart=/usr/bin/prometheus-node-exporter $ARGS
    ExecReload=/bin/kill -HUP $MAINPID
    TimeoutStopSec=20s
    SendSIGKILL=no

    [Install]
    WantedBy=multi-user.target
""")


def _sandbox_templates(role):
    """(src, dest) of every template task in roles/<role>/tasks/sandbox.yml: the test renders what the role writes."""
    tasks = yaml.safe_load((ROOT / "roles" / role / "tasks" / "sandbox.yml").read_text())
    return [(t["ansible.builtin.template"]["src"], t["ansible.builtin.template"]["dest"])
            for t in tasks if "ansible.builtin.template" in t]


# (tree, host, role, template, dest, extra vars). A tree is one host's /etc as the role leaves it.
RENDERS = [
    *(("frontdoor", "pd-router-0", "pd_frontdoor", s, d, {}) for s, d in _sandbox_templates("pd_frontdoor")),
    *(("frontdoor443", "pd-router-0", "pd_frontdoor", s, d, {"pd_frontdoor_port": 443})
      for s, d in _sandbox_templates("pd_frontdoor")),
    ("frontdoor", "pd-router-0", "pd_frontdoor", "pd-frontdoor-mtail.service.j2",
     "/etc/systemd/system/{{ pd_frontdoor_mtail_service_name }}.service", {}),
    *(("observability", "pd-router-0", "observability", s, d, {}) for s, d in _sandbox_templates("observability")),
    *(("vllm_host", "pd-prefill-0", "node_exporter", s, d, {}) for s, d in _sandbox_templates("node_exporter")),
    ("vllm_host", "pd-prefill-0", "node_exporter", "pd-vllm-rss.service.j2", "/etc/systemd/system/pd-vllm-rss.service",
     {}),
    ("vllm_host", "pd-prefill-0", "pd_firewall", "pd-firewall.service.j2",
     "/etc/systemd/system/{{ pd_firewall_service_name }}.service", {}),
    ("frontdoor", "pd-router-0", "pd_router", "pd-router-watch.service.j2",
     "/etc/systemd/system/{{ pd_router_watch_service_name }}.service",
     {"_pd_router_watch_urls": ["http://127.0.0.1:8001"], "_pd_router_units": [{"name": "vllm-router", "mode": "pd"}],
      "_pd_router_watch_argv": ["--router=http://127.0.0.1:8001", "watch", "--workers",
                                "/etc/vllm-router/workers.json"]}),
    ("vllm_host", "pd-prefill-0", "pd_firewall", "pd-firewall-sandbox.conf.j2",
     "/etc/systemd/system/{{ pd_firewall_service_name }}.service.d/" + DROPIN, {}),
]
# (tree, unit, distribution unit file or None for the bundle's own unit)
UNITS = [
    ("frontdoor", "nginx.service", DIST_UNITS / "nginx.service"),
    ("frontdoor443", "nginx.service", DIST_UNITS / "nginx.service"),
    ("frontdoor", "pd-frontdoor-mtail.service", None),
    ("frontdoor", "pd-router-watch.service", None),
    ("observability", "prometheus.service", DIST_UNITS / "prometheus.service"),
    ("observability", "prometheus-alertmanager.service", DIST_UNITS / "prometheus-alertmanager.service"),
    ("vllm_host", "prometheus-node-exporter.service", DEBIAN_NODE_EXPORTER_UNIT),
    ("vllm_host", "pd-vllm-rss.service", None),
    ("vllm_host", "pd-firewall.service", None),
]


def _analyzer_supports_offline_root():
    exe = shutil.which("systemd-analyze")
    if not exe:
        return False
    helptext = subprocess.run([exe, "security", "--help"], capture_output=True, text=True, check=False).stdout
    return "--offline" in helptext and "--threshold" in helptext


needs_analyzer = pytest.mark.skipif(not _analyzer_supports_offline_root(),
                                    reason="systemd-analyze without security --offline/--threshold (systemd >= 250)")


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """Renders every RENDERS entry with ansible (the role's defaults + the embedded default's inventory)."""
    out = tmp_path_factory.mktemp("sandbox")
    plays = []
    for host in sorted({r[1] for r in RENDERS}):
        roles = sorted({r[2] for r in RENDERS if r[1] == host})
        tasks = [{
            "name": f"Render {tree}{dest}",
            "ansible.builtin.template": {"src": str(ROOT / "roles" / role / "templates" / src),
                                         "dest": f"{out}/{tree}{dest}", "mode": "0644"},
            "vars": extra,
            "delegate_to": "localhost",
        } for tree, h, role, src, dest, extra in RENDERS if h == host]
        dirs = sorted({f"{out}/{tree}{os.path.dirname(dest)}"
                       for tree, h, _role, _src, dest, _extra in RENDERS if h == host})
        plays.append({
            "name": f"Render the sandboxed units of {host}", "hosts": host, "connection": "local",
            "gather_facts": False,
            "vars_files": [str(ROOT / "roles" / role / "defaults" / "main.yml") for role in roles],
            "tasks": [{"name": "Directories", "ansible.builtin.file": {"path": "{{ item }}", "state": "directory",
                                                                       "mode": "0755"},
                       "loop": dirs, "delegate_to": "localhost"}, *tasks],
        })
    pb = out / "render.yml"
    pb.write_text(yaml.safe_dump(plays, sort_keys=False))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    p = subprocess.run([str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", str(ROOT / "inventory" / "local"),
                        str(pb)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    return out


def _root_with_dist_unit(trees, tree, unit, dist, tmp_path):
    """A copy of the rendered tree plus the distribution's unit in lib/systemd/system (what the package installs)."""
    root = tmp_path / "root"
    shutil.copytree(trees / tree, root)
    if dist is not None:
        text = dist if isinstance(dist, str) else (dist.read_text() if dist.exists() else None)
        if text is None:
            pytest.skip(f"{dist} not installed here (apt install {dist.stem})")
        (root / "lib/systemd/system").mkdir(parents=True, exist_ok=True)
        (root / "lib/systemd/system" / unit).write_text(text)
        assert (root / "etc/systemd/system" / f"{unit}.d" / DROPIN).is_file(), f"no sandbox drop-in for {unit}"
    return root


def exposure(root, unit):
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={root}", f"--threshold={int(MAX_EXPOSURE * 10)}",
         "--no-pager", unit], capture_output=True, text=True, check=False, timeout=120)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert m, f"no overall exposure in systemd-analyze's output:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return float(m.group(1)), proc.returncode, proc.stdout


def _unit_text(root, unit):
    """The unit as systemd reads it: the unit file, then its drop-ins (keys of the unit's [Service] and drop-ins)."""
    parts = [p for p in (root / "lib/systemd/system" / unit, root / "etc/systemd/system" / unit) if p.exists()]
    parts += sorted((root / "etc/systemd/system" / f"{unit}.d").glob("*.conf"))
    return "\n".join(p.read_text() for p in parts)


def _settings(text):
    return [line.strip() for line in text.splitlines() if "=" in line and not line.lstrip().startswith("#")]


@needs_analyzer
@pytest.mark.parametrize(("tree", "unit", "dist"), UNITS, ids=[f"{t}/{u}" for t, u, _dist in UNITS])
def test_unit_exposure_is_at_most_2_5(trees, tmp_path, tree, unit, dist):
    root = _root_with_dist_unit(trees, tree, unit, dist, tmp_path)
    score, rc, report = exposure(root, unit)
    assert score <= MAX_EXPOSURE, f"{unit}: exposure {score} > {MAX_EXPOSURE}:\n{report}"
    assert rc == 0, report


@needs_analyzer
@pytest.mark.parametrize(("tree", "unit", "dist"), [u for u in UNITS if u[2] is not None],
                         ids=[f"{t}/{u}" for t, u, d in UNITS if d is not None])
def test_the_distribution_unit_alone_scores_above_2_5(trees, tmp_path, tree, unit, dist):
    """The measurement is real: without the drop-in the same unit fails the threshold."""
    root = _root_with_dist_unit(trees, tree, unit, dist, tmp_path)
    (root / "etc/systemd/system" / f"{unit}.d" / DROPIN).unlink()
    score, rc, _stdout = exposure(root, unit)
    assert score > MAX_EXPOSURE and rc != 0


@pytest.mark.parametrize(("tree", "unit", "dist"), UNITS, ids=[f"{t}/{u}" for t, u, _dist in UNITS])
def test_every_unit_keeps_what_it_needs_to_run(trees, tree, unit, dist):
    """The directives that would break a start are the reviewed ones (docs/security.md, per unit)."""
    root = trees / tree
    dist_text = "" if dist is None else dist if isinstance(dist, str) else dist.read_text() if dist.exists() else ""
    settings = _settings(dist_text + "\n" + _unit_text(root, unit))
    # the last CapabilityBoundingSet= wins where the drop-in sets it after the distribution's unit
    caps = [s.split("=", 1)[1].split() for s in settings if s.startswith("CapabilityBoundingSet=")]
    caps = caps[-1] if caps else None
    rw = [s.split("=", 1)[1] for s in settings if s.startswith("ReadWritePaths=")]
    assert "ProtectSystem=strict" in settings
    assert {"NoNewPrivileges=yes", "NoNewPrivileges=true"} & set(settings)
    if unit == "nginx.service":
        # the root master starts www-data workers, hands them its temp dirs and logs, reopens rotated logs
        want = {"CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_KILL"}
        assert set(caps) == want | ({"CAP_NET_BIND_SERVICE"} if tree == "frontdoor443" else set())
        assert rw == ["/var/log/nginx /var/lib/nginx /run"]
        # a fresh log (root:root) must stay readable by mtail: no UMask in the drop-in
        assert not any(s.startswith("UMask=") for s in settings)
    elif unit == "pd-firewall.service":
        assert caps == ["CAP_NET_ADMIN"] and "AF_NETLINK" in next(
            s for s in settings if s.startswith("RestrictAddressFamilies="))
        assert not any(s.startswith("PrivateNetwork=") for s in settings)
    else:
        assert caps == []
        if unit == "prometheus.service":
            assert rw == ["/var/lib/prometheus"]
        elif unit == "prometheus-alertmanager.service":
            assert rw == ["/var/lib/prometheus/alertmanager"]
        elif unit == "pd-vllm-rss.service":
            assert rw == ["/var/lib/prometheus/node-exporter"]
            # it reads other users' processes and /proc/stat
            assert not any(s.startswith(("ProtectProc=", "ProcSubset=")) for s in settings)
        else:
            assert rw == []
    if unit == "pd-frontdoor-mtail.service":
        # adm (nginx's rotated logs) must stay a mapped group
        assert "SupplementaryGroups=adm" in settings and not any(s.startswith("PrivateUsers=") for s in settings)
    if unit == "prometheus-node-exporter.service":
        # /proc/1/mounts (filesystem collector) must stay visible
        assert not any(s.startswith(("ProtectProc=", "ProcSubset=")) for s in settings)
