"""roles/pd_router: the vllm-router command line derived from the topology, checked against the real router.

- pd_router_workers / pd_router_argv on both real inventories (inventory/b300, inventory/local);
- the argv parsed by the installed vllm-router's own parser (launch_router.parse_router_args in
  .cache/router-venv, made by scripts/bootstrap.d/55-router-wheelhouse) and the parsed RouterArgs compared
  with the topology: every prefill/decode URL, ports, policies, timeouts;
- the unit file rendered by Ansible from the role's real tasks and template (ExecStart, sandboxing, no key);
- bad topology fails with a message naming host, instance and field.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml
from ansible_collections.b300.pd.plugins.plugin_utils import pd_router as pdr

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "pd_router"
ROUTER_VENV = ROOT / ".cache" / "router-venv"
ROUTER_PY = ROUTER_VENV / "bin" / "python"
ANY = "0.0.0.0"  # noqa: S104 - the router's bind address in the inventories, compared not bound here

from ansible_collections.b300.pd.bench.pd_cluster import load as load_cluster  # noqa: E402
from ansible_collections.b300.pd.tests.unit.pd_testlib import load_inventory  # noqa: E402

DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())


@functools.cache
def cluster_view_of(name):
    """The view of inventory/<name> as bench/pd_cluster.py composes it (what validate.yml publishes as pd_cluster)."""
    return load_cluster(ROOT / "inventory" / name)


def settings(**over):
    s = {
        "kv_connector": DEFAULTS["pd_router_kv_connector"], "host": ANY, "port": 8000,
        "metrics_host": ANY, "metrics_port": 29000, "policy": DEFAULTS["pd_router_policy"],
        "prefill_policy": DEFAULTS["pd_router_prefill_policy"], "decode_policy": DEFAULTS["pd_router_decode_policy"],
        "health_check_endpoint": "/health", "health_check_interval_secs": 10, "health_check_timeout_secs": 5,
        "health_failure_threshold": 3, "health_success_threshold": 2, "worker_startup_timeout_secs": 1800,
        "worker_startup_check_interval": 10, "retry_max_retries": 3, "retry_initial_backoff_ms": 100,
        "retry_max_backoff_ms": 5000, "request_timeout_secs": 1800, "queue_timeout_secs": 60, "log_level": "info",
        "extra_args": {}, "api_key_env": "",
    }
    s.update(over)
    return s


def topo(name):
    """The cluster view of inventory/<name> (what validate.yml publishes as pd_cluster) and its vLLM hosts."""
    view = cluster_view_of(name)
    return view, list(dict.fromkeys(i["host"] for i in view["instances"]))


def parse_with_router(argv):
    """Parse argv with the installed vllm-router's own parser; returns its RouterArgs as a dict."""
    if not ROUTER_PY.exists():
        pytest.fail(f"{ROUTER_PY} missing: run `scripts/bootstrap --local` (stage 55-router-wheelhouse)")
    code = textwrap.dedent("""
        import dataclasses, json, sys
        from vllm_router.launch_router import parse_router_args
        ra = parse_router_args(json.loads(sys.argv[1]))
        print(json.dumps(dataclasses.asdict(ra), default=str))
    """)
    p = subprocess.run([str(ROUTER_PY), "-c", code, json.dumps(argv)], capture_output=True, text=True,
                       timeout=60, check=False)
    return p.returncode, (json.loads(p.stdout) if p.returncode == 0 else None), p.stderr


def test_b300_workers_are_every_instance_in_inventory_order():
    view, hosts = topo("b300")
    w = pdr.pd_router_workers(view, hosts)
    assert [x["url"] for x in w["prefill"]] == [
        "http://192.0.2.11:8100", "http://192.0.2.11:8101", "http://192.0.2.12:8100", "http://192.0.2.12:8101"]
    assert [x["name"] for x in w["prefill"]] == ["prefill-a", "prefill-b", "prefill-c", "prefill-d"]
    assert [x["url"] for x in w["decode"]] == ["http://192.0.2.13:8200"]


@pytest.mark.parametrize("inv", ["b300", "local"])
def test_argv_is_accepted_by_the_real_router_and_means_the_topology(inv):
    view, hosts = topo(inv)
    w = pdr.pd_router_workers(view, hosts)
    argv = pdr.pd_router_argv(w, settings())
    rc, ra, err = parse_with_router(argv)
    assert rc == 0, err
    assert ra["vllm_pd_disaggregation"] is True
    # Prefill entries parsed as (url, bootstrap_port=None) in topology order; decode URLs likewise.
    assert [p[0] for p in ra["prefill_urls"]] == [x["url"] for x in w["prefill"]]
    assert all(p[1] is None for p in ra["prefill_urls"])
    assert ra["decode_urls"] == [x["url"] for x in w["decode"]]
    assert (ra["host"], ra["port"]) == (ANY, 8000)
    assert (ra["prometheus_host"], ra["prometheus_port"]) == (ANY, 29000)
    assert ra["prefill_policy"] == DEFAULTS["pd_router_prefill_policy"]
    assert ra["decode_policy"] == DEFAULTS["pd_router_decode_policy"]
    assert ra["request_timeout_secs"] == 1800
    assert ra["retry_max_retries"] == 3
    assert ra["health_check_interval_secs"] == 10
    assert ra["kv_connector"] == "nixl"


def test_router_rejects_what_it_does_not_know():
    """The validation is real: a flag the installed router lacks, or a bad policy, fails parsing."""
    view, hosts = topo("local")
    w = pdr.pd_router_workers(view, hosts)
    rc, _parsed, err = parse_with_router(pdr.pd_router_argv(w, settings(extra_args={"no-such-router-flag": 3})))
    assert rc != 0 and "no-such-router-flag" in err
    rc, _parsed, err = parse_with_router(pdr.pd_router_argv(w, settings(decode_policy="fastest")))
    assert rc != 0 and "fastest" in err


def test_every_default_flag_exists_in_router_help():
    if not (ROUTER_VENV / "bin" / "vllm-router").exists():
        pytest.fail("router venv missing: run scripts/bootstrap.d/55-router-wheelhouse")
    helptext = subprocess.run([str(ROUTER_VENV / "bin" / "vllm-router"), "--help"], capture_output=True, text=True,
                              timeout=60, check=True).stdout
    view, hosts = topo("b300")
    w = pdr.pd_router_workers(view, hosts)
    units = pdr.pd_router_units(load_inventory("b300")["group_vars"]["pd_router_units"], w,
                                {**settings(), "client_port": 8000})
    flags = {a for u in units for a in u["argv"] if a.startswith("--")}
    assert "--worker-urls" in flags and "--vllm-pd-disaggregation" in flags  # both modes rendered
    missing = [f for f in flags if f + " " not in helptext and f + "\n" not in helptext]
    assert not missing, f"flags not in vllm-router --help: {missing}"


def test_api_key_is_never_in_argv_and_the_launcher_refuses_it(tmp_path):
    """The workers' key reaches vllm-router through a systemd credential read by the launcher, never argv."""
    view, hosts = topo("local")
    workers = pdr.pd_router_workers(view, hosts)
    with pytest.raises(Exception, match=r"pd_router_extra_args sets '--api-key'"):
        pdr.pd_router_argv(workers, settings(extra_args={"api-key": "s3cret"}))
    launcher = ROLE / "files" / "pd_router_launch.py"
    p = subprocess.run([str(ROUTER_PY), str(launcher), "--api-key", "s3cret", "--worker-urls", "http://x:1"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2 and "systemd credential" in p.stderr
    # With the credential: the launcher's parsed arguments carry the key (checked without starting a router).
    cred = tmp_path / "worker-api-key"
    cred.write_text("s3cret\n")
    probe = (f"import runpy, sys; import vllm_router.launch_router as lr; lr.launch_router = "
             f"lambda a: print('KEY=' + str(a.api_key)); sys.argv = ['x', '--worker-urls', 'http://x:1']; "
             f"runpy.run_path({str(launcher)!r}, run_name='__main__')")
    p = subprocess.run([str(ROUTER_PY), "-c", probe], capture_output=True, text=True, timeout=60, check=False,
                       env={**os.environ, "CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert "KEY=s3cret" in p.stdout, p.stdout + p.stderr


def test_extra_args_follow_the_flag_convention_and_cannot_shadow_owned_flags():
    view, hosts = topo("local")
    w = pdr.pd_router_workers(view, hosts)
    argv = pdr.pd_router_argv(w, settings(extra_args={"disable-circuit-breaker": True, "cors-allowed-origins": None,
                                                      "queue-size": 50}))
    assert "--disable-circuit-breaker" in argv and "--cors-allowed-origins" not in argv
    assert argv[argv.index("--queue-size") + 1] == "50"
    with pytest.raises(Exception, match=r"pd_router_extra_args sets '--decode'"):
        pdr.pd_router_argv(w, settings(extra_args={"decode": "http://x:1"}))


def test_workers_come_from_the_cluster_view_only():
    """Names, pools and ports are checked once (validate.yml); the role only selects, and says what is missing."""
    view, hosts = topo("local")
    with pytest.raises(Exception, match=r"pd_cluster \(the cluster view\) is not defined.*playbooks/validate.yml"):
        pdr.pd_router_workers(None, hosts)
    with pytest.raises(Exception, match=r"no decode instance on the hosts of pd_router_worker_group \(pd-prefill-0\)"):
        pdr.pd_router_workers(view, ["pd-prefill-0"])


def test_same_port_for_api_and_metrics_is_refused():
    view, hosts = topo("local")
    with pytest.raises(Exception, match="both 8000"):
        pdr.pd_router_argv(pdr.pd_router_workers(view, hosts), settings(metrics_port=8000))


def test_quote_for_systemd_round_trips_through_a_shell_split():
    argv = ["--prefill", "http://10.0.0.1:8100", "none", "--x", '{"a": "b c"}', "--p", "50%", "${KEY}"]
    line = pdr.pd_router_quote(argv)
    assert "%%" in line and "${KEY}" in line
    # systemd's quoting is shell-like; shlex gives the same split once %% is unescaped.
    assert shlex.split(line.replace("%%", "%")) == argv


def test_unit_rendered_by_ansible_from_the_role(tmp_path):
    """Runs the role's real config tasks and unit template through ansible-playbook on localhost, per unit."""
    inv_dir = ROOT / "inventory" / "local"
    pb = tmp_path / "render.yml"
    pb.write_text(textwrap.dedent(f"""
        - name: Render the router units
          hosts: pd-router-0
          connection: local
          gather_facts: false
          vars:
            pd_router_api_key: "s3cret-should-not-appear"
            pd_cluster: {json.dumps(cluster_view_of("local"))}
          tasks:
            - name: Derive
              ansible.builtin.include_role:
                name: b300.pd.pd_router
                tasks_from: config.yml
                public: true
            - name: Template
              ansible.builtin.template:
                src: "{ROLE}/templates/vllm-router.service.j2"
                dest: "{tmp_path}/{{{{ _pd_router_unit.name }}}}.service"
                mode: "0644"
              loop: "{{{{ _pd_router_units }}}}"
              loop_control:
                loop_var: _pd_router_unit
              delegate_to: localhost
    """))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    p = subprocess.run([str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", str(inv_dir), str(pb)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    units = load_inventory("local")["group_vars"]["pd_router_units"]
    assert sorted(f.name for f in tmp_path.glob("*.service")) == sorted(f"{u['name']}.service" for u in units)
    for u in units:
        unit = (tmp_path / f"{u['name']}.service").read_text()
        assert "s3cret" not in unit
        exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
        args = shlex.split(exec_line[len("ExecStart="):])
        assert args[:2] == ["/opt/vllm-router/current/bin/python", "/opt/vllm-router/bin/pd-router-launch"]
        assert "--api-key" not in args
        assert "LoadCredential=worker-api-key:/etc/vllm-router/worker-api-key" in unit.splitlines()
        assert (args[args.index("--host") + 1], args[args.index("--port") + 1]) == ("127.0.0.1", str(u["port"]))
        if u["mode"] == "pd":
            prefills = [args[i + 1] for i, a in enumerate(args) if a == "--prefill"]
            decodes = [args[i + 1] for i, a in enumerate(args) if a == "--decode"]
            assert prefills == ["http://10.237.0.11:8100", "http://10.237.0.11:8101"]
            assert decodes == ["http://10.237.0.12:8200"]
        else:
            i = args.index("--worker-urls")
            assert args[i + 1:i + 3] == ["http://10.237.0.11:8100", "http://10.237.0.11:8101"]
            assert "--decode" not in args and "--vllm-pd-disaggregation" not in args
        for line in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                     "CapabilityBoundingSet=", "Restart=on-failure", "User=vllm-router"):
            assert line in unit.splitlines(), line
        # And the real router accepts exactly what the unit would run.
        rc, _parsed, err = parse_with_router(args[2:])
        assert rc == 0, err
        # systemd's own exposure score of the unit (issue #18): <= 2.5.
        if shutil.which("systemd-analyze"):
            r = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(tmp_path / f"{u['name']}.service")],
                               capture_output=True, text=True, timeout=120, check=False)
            score = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout + r.stderr)
            assert score and float(score.group(1)) <= 2.5, r.stdout[-2000:] + r.stderr[-500:]
