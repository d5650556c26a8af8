"""Every inventory string checked where it is written (issue 32, item 4).

Each case of the issue is refused twice: by the validation (pd_topology through playbooks/validate.yml, naming the
field and the fix, before any host is touched) and again by the writer that would put it into a file when the
validation was skipped. The shared rules are plugins/module_utils/pd_input_rules.py.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess

import pytest
import yaml
from ansible_collections.b300.pd.bench.pd_cluster import inventory_data
from ansible_collections.b300.pd.plugins.module_utils import pd_input_rules as rules
from ansible_collections.b300.pd.plugins.module_utils import pd_inventory_rules, pd_topology, pd_unit
from ansible_collections.b300.pd.plugins.module_utils.pd_cluster_inputs import inventory_values
from ansible_collections.b300.pd.plugins.module_utils.pd_cluster_view import TopologyError, cluster_view, view_inputs
from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import RecipeError
from ansible_collections.b300.pd.plugins.plugin_utils import pd_frontdoor, pd_inputs, pd_router, vllm_install
from ansible_collections.b300.pd.plugins.plugin_utils.pd_role_defaults import role_defaults
from ansible_collections.b300.pd.tests.unit.pd_testlib import (
    ROOT,
    load_inventory,
    load_library,
    run_module,
    topology_input,
)

# The issue's values.
SPACED_PATH = "/srv/x /etc"
ROUTER_ARG = "info\nExecStartPre=/bin/sh -c 'touch /tmp/pwned'"
UPSTREAM = "1.2.3.4:80 ; server 6.6.6.6"
ESCAPING_NAME = "../../etc/cron.d/x"
GROUPS = {"all": ["v1", "gw"], "vllm_hosts": ["v1"], "router_hosts": ["gw"], "monitoring_hosts": ["gw"]}


def _base():
    inv = load_inventory("b300")
    return topology_input(inv), copy.deepcopy(inv["recipe"]), dict(inv["group_vars"]["pd_sla"])


def _inventory_problems(gw=None, v1=None):
    hostvars = {"v1": {"ansible_host": "192.0.2.11", **(v1 or {})}, "gw": {"ansible_host": "192.0.2.20", **(gw or {})}}
    values = inventory_values(GROUPS, hostvars, pd_inventory_rules.INVENTORY_VARS)
    return pd_inventory_rules.validate_inventory(GROUPS, values)


# --- the shared rules ---------------------------------------------------------------------------------------------

def test_check_strings_names_the_nested_string_and_passes_clean_values():
    assert rules.check_strings("f", {"a": ["ok", 1, None, {"b": "c"}]}) == {"a": ["ok", 1, None, {"b": "c"}]}
    with pytest.raises(rules.InputError, match=r"^f\.a\[1\]: 'b\\nc' contains the control character U\+000A"):
        rules.check_strings("f", {"a": ["ok", "b\nc"]})
    with pytest.raises(rules.InputError, match=r"^f \(key 'k\\r'\)"):
        rules.check_strings("f", {"k\r": 1})


@pytest.mark.parametrize("value", ["fe80::1%eth0 ; server 6.6.6.6", 'fe80::1%a"b', "fe80::1%x y"])
def test_an_ipv6_zone_carries_no_injection(value):
    """Python's ipaddress keeps any text after '%' (found by the property test): the zone must be an interface name
    for a host, and a firewall address takes none."""
    with pytest.raises(rules.InputError, match="is neither an IP address nor a DNS name"):
        rules.check_host("f", value)
    with pytest.raises(rules.InputError, match="is not an IP address or network"):
        rules.check_address("f", value)
    assert rules.check_host("f", "fe80::1%eth0") == "fe80::1%eth0"


# --- validate: each issue case named with its field and fix ------------------------------------------------------

@pytest.mark.parametrize("where", ["extra_env", "pd_vllm_env", "pd_ucx_env"])
@pytest.mark.parametrize("value", [SPACED_PATH, "/srv/x'y", '/srv/"x"', "/srv/../etc", "/srv/x;/etc"])
def test_validate_refuses_a_writable_env_path_that_splits_readwritepaths(where, value):
    hosts, recipe, sla = _base()
    if where == "extra_env":
        hosts["b300-01"]["pd_instances"][0]["extra_env"] = {"TMPDIR": value}
    else:
        recipe[where] = {**(recipe.get(where) or {}), "TMPDIR": value}
    problems = pd_topology.validate_topology(hosts, recipe, sla)
    line = [p for p in problems if f"field {where}.TMPDIR" in p]
    assert line, problems
    assert "is not a plain absolute path; use '/' followed by letters" in line[0]


@pytest.mark.parametrize("value", ["/", "/mnt", "/mnt/model/glm/cache"])
def test_validate_refuses_a_writable_env_path_the_unit_writer_refuses(value):
    """Found by the property test: the unit writer refuses a path that makes the model directory writable; the
    validation now says so before any host is touched, not at deploy."""
    hosts, recipe, sla = _base()
    hosts["b300-01"]["pd_instances"][0]["extra_env"] = {"HF_HOME": value}
    problems = pd_topology.validate_topology(hosts, recipe, sla)
    assert any(p.startswith("host b300-01, instance prefill-a, field extra_env.HF_HOME: ") and
               "would make the model directory" in p and "point it outside" in p for p in problems), problems


def test_validate_accepts_a_plain_writable_env_path():
    hosts, recipe, sla = _base()
    hosts["b300-01"]["pd_instances"][0]["extra_env"] = {"TMPDIR": "/srv/scratch/vllm-tmp", "HF_HOME": "rel/dir"}
    assert pd_topology.validate_topology(hosts, recipe, sla) == []


def test_validate_refuses_a_vllm_host_address_with_a_port():
    hosts, recipe, sla = _base()
    hosts["b300-02"]["ansible_host"] = "192.0.2.12:22"
    problems = pd_topology.validate_topology(hosts, recipe, sla)
    assert any(p.startswith("host b300-02, field ansible_host: '192.0.2.12:22' is neither an IP address nor a DNS "
                            "name; give the address alone") for p in problems), problems


def test_validate_refuses_a_router_only_hosts_address():
    problems = _inventory_problems(gw={"ansible_host": UPSTREAM})
    assert problems == [f"host gw, field ansible_host: {UPSTREAM!r} is neither an IP address nor a DNS name; give the "
                        "address alone (no port, no spaces): the port comes from its own variable"]


def test_validate_names_the_firewall_addresses_field_of_the_wrong_type():
    problems = _inventory_problems(gw={"pd_firewall_host_addresses": 5}, v1={"pd_firewall_host_addresses": 5})
    assert problems == ["host v1, gw, field pd_firewall_host_addresses: 5 is int, expected a list; set "
                        "pd_firewall_host_addresses to a list"]
    problems = _inventory_problems(gw={"pd_firewall_extra_peers": ["10.0.0.0/24", "10.0.0.1 10.0.0.2"]})
    assert problems == ["host gw, field pd_firewall_extra_peers[1]: '10.0.0.1 10.0.0.2' is not an IP address or "
                        "network; use e.g. 10.0.0.5, 10.0.0.0/24 or fd00::5"]


@pytest.mark.parametrize(("var", "value", "expected"), [
    ("pd_router_extra_args", {"max-payload-size": ROUTER_ARG},
     "field pd_router_extra_args.max-payload-size: " + repr(ROUTER_ARG)[:77]),
    ("pd_router_extra_args", {"log-level": ROUTER_ARG},
     "field pd_router_extra_args sets '--log-level', which the role renders from its own variable; remove it"),
    ("pd_router_extra_args", {"max payload": 1}, "field pd_router_extra_args: flag 'max payload' is not a long option"),
    ("pd_router_extra_args", {"x": {"k": ["a\rb"]}}, "field pd_router_extra_args.x.k[0]: 'a\\rb' contains"),
    ("pd_router_extra_args", "--x", "field pd_router_extra_args: '--x' is str, expected a mapping"),
    ("pd_router_bind_host", "0.0.0.0 --x", "field pd_router_bind_host: '0.0.0.0 --x' is neither an IP address"),
    ("pd_router_log_level", "info\n", "field pd_router_log_level: 'info\\n' contains the control character"),
    ("pd_router_units", [{"name": "vllm-router/../x", "mode": "pd", "port": 8001, "metrics_port": 29000}],
     "field pd_router_units[0].name: 'vllm-router/../x' is not a router unit name; use 'vllm-router' followed"),
    ("pd_router_prefix", "/opt/vllm router", "field pd_router_prefix: '/opt/vllm router' is not a plain absolute"),
    ("pd_router_user", "root\nExecStartPre=/x", "field pd_router_user: 'root\\nExecStartPre=/x' contains the control"),
    ("pd_router_version", "0.1.17 --pre", "field pd_router_version: '0.1.17 --pre' is not a name"),
    ("pd_frontdoor_bind_host", "0.0.0.0:80 ssl", "field pd_frontdoor_bind_host: '0.0.0.0:80 ssl' is neither"),
    ("pd_frontdoor_access_log", "/var/log/x.log main", "field pd_frontdoor_access_log: '/var/log/x.log main' is not"),
    ("observability_alertmanager_listen_address", "127.0.0.1 --web.config.file=/x",
     "field observability_alertmanager_listen_address: '127.0.0.1 --web.config.file=/x' is neither"),
    ("observability_alertmanager_group_wait", "5s\nroute:", "field observability_alertmanager_group_wait: '5s\\nro"),
    # a C1 control character (Hypothesis found U+0080 passing validate while the unit writer's rule refused it)
    ("observability_alertmanager_group_wait", "5s\x80", "field observability_alertmanager_group_wait: '5s\\x80'"),
    ("observability_alertmanager_receivers", {"name": "x"},
     "field observability_alertmanager_receivers: {'name': 'x'} is dict, expected a list"),
])
def test_validate_refuses_router_frontdoor_and_alertmanager_values(var, value, expected):
    problems = _inventory_problems(gw={var: value})
    assert len(problems) == 1 and problems[0].startswith(f"host gw, {expected}"), problems


def test_validate_does_not_show_a_receivers_value_that_may_hold_a_credential():
    url = "https://hooks.example/T0KEN\nx"
    problems = _inventory_problems(gw={"observability_alertmanager_receivers": [
        {"name": "ops", "webhook_configs": [{"url": url}]}]})
    assert problems == ["host gw, field observability_alertmanager_receivers[0].webhook_configs[0].url: contains a "
                        "control character (the value is not shown: it may hold a credential); it would split the "
                        "line it is written to: remove it"]
    assert "T0KEN" not in problems[0]


def test_validate_refuses_the_workers_key_in_router_args_without_showing_it():
    problems = _inventory_problems(gw={"pd_router_extra_args": {"--api-key": "s3cret-w0rker\nx"}})
    assert problems == ["host gw, field pd_router_extra_args sets '--api-key', which the role renders from its own "
                        "variable; remove it from pd_router_extra_args and set the pd_router_ variable instead"]


def test_validate_refuses_an_instance_name_that_leaves_its_directory():
    hosts, recipe, sla = _base()
    hosts["b300-01"]["pd_instances"][0]["name"] = ESCAPING_NAME
    problems = pd_topology.validate_topology(hosts, recipe, sla)
    assert any("field name: '../../etc/cron.d/x' is not a valid name" in p for p in problems), problems


@pytest.mark.parametrize("inv", ["b300", "local"])
def test_shipped_inventories_and_role_defaults_pass_the_inventory_rules(inv):
    groups, hostvars = inventory_data(ROOT / "inventory" / inv)
    values = inventory_values(groups, hostvars, pd_inventory_rules.INVENTORY_VARS)
    assert any(values[h] for h in groups["all"])  # it did read something
    assert pd_inventory_rules.validate_inventory(groups, values) == []
    # The roles' own defaults (a Jinja default is the collection's own and not checked) pass too.
    defaults = {var: value for role in role_defaults().values() for var, value in role.items()
                if var in pd_inventory_rules.INVENTORY_VARS and "{{" not in str(value)}
    assert pd_inventory_rules.validate_inventory(GROUPS, {"v1": defaults, "gw": defaults}) == []


# --- validate.yml itself on the b300 inventory changed in one place per case --------------------------------------

def _edit_yaml(path, change):
    data = yaml.safe_load(path.read_text()) or {}
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _hostile_b300(inv):
    def instance(data):
        data["pd_instances"][0]["extra_env"] = {"TMPDIR": SPACED_PATH}
        data["pd_instances"][1]["name"] = ESCAPING_NAME

    def router(data):
        data["pd_router_extra_args"] = {"max-payload-size": ROUTER_ARG}
        data["pd_firewall_host_addresses"] = 5

    def gateway(data):
        data["b300"]["children"]["router_hosts"]["hosts"]["b300-gw"] = {"ansible_host": UPSTREAM}

    _edit_yaml(inv / "host_vars" / "b300-01.yml", instance)
    _edit_yaml(inv / "group_vars" / "all" / "router.yml", router)
    _edit_yaml(inv / "hosts.yml", gateway)


def _run_validate(inv):
    """validate.yml's topology task only (tagged always; the other plays have their own tags): the control node,
    no host contacted, no vLLM parser. Returns (rc, the task's problem lines, the whole output)."""
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_STDOUT_CALLBACK="ansible.builtin.json")
    proc = subprocess.run(  # noqa: S603 - the repo's own ansible-playbook
        [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", str(inv), str(ROOT / "playbooks" / "validate.yml"),
         "--tags", "pd-input-rules-test", "-e", "pd_control_vllm_python=none",
         # The vault's workers' key (validate refuses a deploy without one).
         "-e", "vault_pd_router_api_key=" + "0" * 64],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False,
    )
    out = proc.stdout + proc.stderr
    assert "{" in proc.stdout, out
    report, _end = json.JSONDecoder().raw_decode(proc.stdout[proc.stdout.index("{"):])  # profile_tasks' lines around
    problems = [line for play in report["plays"] for task in play["tasks"]
                if task["task"]["name"].startswith("Validate the topology")
                for result in task["hosts"].values() for line in result.get("problems") or []]
    return proc.returncode, problems, out


@pytest.mark.parametrize("hostile", [False, True], ids=["b300-as-shipped", "b300-with-every-issue-case"])
def test_validate_playbook_refuses_every_issue_case_naming_field_and_fix(tmp_path, hostile):
    inv = tmp_path / "b300"
    shutil.copytree(ROOT / "inventory" / "b300", inv)
    if hostile:
        _hostile_b300(inv)
    rc, problems, out = _run_validate(inv)
    if not hostile:
        assert rc == 0 and problems == [], out
        return
    assert rc != 0, out
    assert "Traceback" not in out and "not iterable" not in out, out
    expected = [
        "host b300-01, instance prefill-a, field extra_env.TMPDIR: '/srv/x /etc' is not a plain absolute path; use "
        "'/' followed by letters, digits and '_.@%+=:,/-' only (no spaces, quotes or '..': it is written into a path "
        "list)",
        "host b300-01, instance ../../etc/cron.d/x, field name: '../../etc/cron.d/x' is not a valid name; use "
        "lowercase letters, digits and '-' (it becomes vllm-<name>.service)",
        f"host b300-03, b300-02, b300-gw, field pd_router_extra_args.max-payload-size: {ROUTER_ARG!r} contains the "
        "control character U+000A at 4; it would split the line it is written to: remove it",
        "host b300-01, b300-02, b300-03, b300-gw, field pd_firewall_host_addresses: 5 is int, expected a list; set "
        "pd_firewall_host_addresses to a list",
        f"host b300-gw, field ansible_host: {UPSTREAM!r} is neither an IP address nor a DNS name; give the address "
        "alone (no port, no spaces): the port comes from its own variable",
    ]
    for line in expected:
        assert line in problems, (line, problems)


def test_provision_playbook_validates_first():
    """provision.yml alone (a repair, --limit) writes nothing that validate.yml refuses: it imports it first."""
    plays = yaml.safe_load((ROOT / "playbooks" / "provision.yml").read_text())
    assert plays[0].get("ansible.builtin.import_playbook") == "validate.yml", plays[0]


# --- the writers refuse the same values when validate.yml was skipped ---------------------------------------------

WORKERS = {"prefill": [{"name": "p", "host": "h1", "url": "http://192.0.2.11:8100"}],
           "decode": [{"name": "d", "host": "h2", "url": "http://192.0.2.12:8200"}]}
SETTINGS = {"host": "0.0.0.0", "port": 8001, "metrics_host": "0.0.0.0", "metrics_port": 29000,  # noqa: S104
            "log_level": "info", "policy": "round_robin"}


@pytest.mark.parametrize(("change", "field"), [
    ({"extra_args": {"max-payload-size": ROUTER_ARG}}, "pd_router_extra_args.max-payload-size"),
    ({"extra_args": {"x": ["a", "b\nc"]}}, r"pd_router_extra_args.x\[1\]"),
    ({"extra_args": {"bad flag": 1}}, "pd_router_extra_args: flag 'bad flag'"),
    ({"host": "0.0.0.0 --x"}, "pd_router_bind_host"),
    ({"metrics_host": UPSTREAM}, "pd_router_metrics_bind_host"),
    ({"log_level": "info\nExecStartPre=/bin/sh"}, "pd_router_log_level"),
    ({"health_check_endpoint": "/health\r"}, "pd_router_health_check_endpoint"),
])
def test_router_filters_refuse_what_validate_refuses(change, field):
    with pytest.raises(rules.InputError, match=f"^{field}"):
        pd_router.pd_router_argv(WORKERS, {**SETTINGS, **change})
    units = [{"name": "vllm-router", "mode": "pd", "port": 8001, "metrics_port": 29000}]
    with pytest.raises(rules.InputError, match=f"^{field}"):
        pd_router.pd_router_units(units, WORKERS, {**SETTINGS, "client_port": 8000, **change})


@pytest.mark.parametrize(("args", "field"), [
    (("vllm", "0.32.0\n"), "vllm_install_version"),
    (("vllm\n", "0.32.0"), "vllm_install_package"),
    (("vllm", "0.32.0", "rebuilt\n"), "vllm_install_venv_suffix"),
])
def test_venv_name_refuses_a_trailing_newline(args, field):
    """The venv directory's name (a path on every vLLM host): '$' matched before a trailing newline."""
    with pytest.raises(ValueError, match=f"^{field}: "):
        vllm_install.venv_name(*args)
    assert vllm_install.venv_name("vllm", "0.32.0", "rebuilt") == "vllm-0.32.0-rebuilt"


def test_router_quote_refuses_a_control_character_whatever_its_source():
    assert pd_router.pd_router_quote(["--log-level", "info", "${X}"]) == "--log-level info ${X}"
    with pytest.raises(rules.InputError, match=r"^pd_router_quote: vllm-router argument 1: 'info\\nExecStartPre"):
        pd_router.pd_router_quote(["--log-level", "info\nExecStartPre=/bin/sh"])
    # The filter as the role calls it (plugins/filter/pd.py): the same message as an Ansible filter error.
    from ansible.errors import AnsibleFilterError
    from ansible_collections.b300.pd.plugins.filter.pd import FilterModule
    with pytest.raises(AnsibleFilterError, match="vllm-router argument 0"):
        FilterModule().filters()["pd_router_quote"](["a\u2028b"])


# Writers owned by other helpers of issue 32 (H2: pd_unit / vllm_instance / pd_recipe, H1: the firewall's peers in
# the cluster view, H5: the front door's upstreams): each must raise the shared rules' InputError (or RecipeError).

def test_unit_writer_refuses_a_writable_env_path_that_splits_readwritepaths(local_inv):
    inst = dict(local_inv["hosts"]["pd-prefill-0"]["pd_instances"][0], extra_env={"TMPDIR": SPACED_PATH})
    with pytest.raises((RecipeError, rules.InputError), match="TMPDIR"):
        pd_unit.unit_writable_paths(local_inv["recipe"], inst)
    with pytest.raises((RecipeError, rules.InputError), match="TMPDIR"):
        pd_unit.render_unit(local_inv["recipe"], inst, "/opt/vllm/current/bin/python", "vllm")


def test_unit_writer_refuses_a_served_model_name_with_a_newline(local_inv):
    recipe = dict(local_inv["recipe"], pd_served_model_name="tiny\n[Service]\nExecStartPre=/bin/sh")
    inst = local_inv["hosts"]["pd-prefill-0"]["pd_instances"][0]
    with pytest.raises((RecipeError, rules.InputError), match="pd_served_model_name"):
        pd_unit.render_unit(recipe, inst, "/opt/vllm/current/bin/python", "vllm")


def test_vllm_instance_module_refuses_a_name_that_leaves_its_directory(tmp_path, local_inv, monkeypatch):
    for d in ("units", "etc-vllm", "state"):
        (tmp_path / d).mkdir()
    host = local_inv["hosts"]["pd-prefill-0"]
    args = {"instance": dict(host["pd_instances"][0], name=ESCAPING_NAME), "recipe": local_inv["recipe"],
            "host_address": host["ansible_host"], "python": "/opt/vllm/current/bin/python",
            "validate_flags": False, "user": "vllm", "unit_dir": str(tmp_path / "units"),
            "env_dir": str(tmp_path / "etc-vllm"), "state_root": str(tmp_path / "state"),
            "pin_model_revision": False}

    def no_command(self, *a, **kw):
        raise AssertionError("the module ran a command for a refused instance")

    res, failed = run_module(load_library("vllm_instance").main, args, run_command=no_command,
                             monkeypatch=monkeypatch)
    assert failed and "'../../etc/cron.d/x' is not a name" in res["msg"], res
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_cluster_view_names_the_firewall_addresses_field_of_the_wrong_type():
    """The module composing the view with the gathered inventory (validate.yml run without the action plugin's
    check, bench/pd_cluster.py): a problem naming the field, not "'int' object is not iterable"."""
    groups, hostvars = inventory_data(ROOT / "inventory" / "b300")
    hostvars = {h: dict(hv, pd_firewall_host_addresses=5 if h == "b300-02" else hv.get("pd_firewall_host_addresses"))
                for h, hv in hostvars.items()}
    with pytest.raises((rules.InputError, TopologyError), match="b300-02.*pd_firewall_host_addresses"):
        cluster_view(*view_inputs(groups, hostvars, role_defaults()))


def test_frontdoor_refuses_an_upstream_address_that_is_not_a_host():
    cluster = {"routers": [
        {"host": "r1", "address": "192.0.2.13", "units": [{"name": "vllm-router", "mode": "pd", "port": 8001}]},
        {"host": "gw", "address": UPSTREAM, "units": [{"name": "vllm-router", "mode": "pd", "port": 8001}]}]}
    # The shared rule's message (check_host), through the filter's error (PdFilterError) or as InputError.
    with pytest.raises(ValueError, match=r"ansible_host: '1\.2\.3\.4:80 ; server 6\.6\.6\.6' is neither an IP address"):
        pd_frontdoor.pd_frontdoor_backends(cluster, "r1", "0.0.0.0")  # noqa: S104


@pytest.mark.parametrize("value", ["127.0.0.1 --web.config.file=/x", "127.0.0.1:9093", '"0.0.0.0"', ""])
def test_alertmanager_listen_address_is_refused_where_it_is_written(value):
    """The Alertmanager unit's argument line (alertmanager.default.j2) takes the address through the filter that
    checks it again with validate's rule."""
    with pytest.raises(ValueError, match="^observability_alertmanager_listen_address: "):
        pd_inputs.pd_listen_address(value, 9093, "observability_alertmanager_listen_address")
    with pytest.raises(ValueError, match="^observability_alertmanager_port: "):
        pd_inputs.pd_listen_address("127.0.0.1", "9093 --x", "observability_alertmanager_listen_address",
                                    "observability_alertmanager_port")
    assert pd_inputs.pd_listen_address("::1", "9093") == "[::1]:9093"
    template = (ROOT / "roles/observability/templates/alertmanager.default.j2").read_text()
    assert "observability_alertmanager_listen_address | b300.pd.pd_listen_address(" in template
