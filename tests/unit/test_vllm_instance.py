"""plugins/modules/vllm_instance.py: validation gate, atomic writes, check mode, diff, idempotence, restart_required.

run_command is faked here (the real vLLM parser is exercised in test_vllm_instance_real_parser below).
"""

from __future__ import annotations

import grp
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from ansible_collections.b300.pd.plugins.module_utils import pd_vllm_argcheck
from ansible_collections.b300.pd.plugins.module_utils.pd_vllm_plugins import plugin_digests
from ansible_collections.b300.pd.tests.unit.pd_testlib import (
    VLLM_VENV_PY,
    load_inventory,
    load_library,
    need_vllm_venv,
    run_module,
)

vllm_instance = load_library("vllm_instance")

GROUP = grp.getgrgid(os.getgid()).gr_name


def harness_output(report):
    """stdout of the vLLM parser harness (plugins/module_utils/pd_vllm_argcheck.py), vLLM's own lines around it."""
    return "INFO noise\n" + pd_vllm_argcheck.RESULT_MARKER + json.dumps(report) + "\n"


def ok_parser(calls):
    def fake(self, args, data=None, **kw):
        req = json.loads(data)
        calls.append({"args": args, "argv": req["instances"][0]["argv"], **req})
        results = [{"instance": i["instance"], "problems": []} for i in req["instances"]]
        return 0, harness_output({"ok": True, "version": "0.32.0", "nixl": "0.7.1", "results": results}), ""
    return fake


def rejecting_parser(error, stage="parse"):
    """The harness refusing an argv (stage parse: a problem line as it words them), or unable to parse at all."""
    def fake(self, args, data=None, **kw):
        if stage in ("import", "entrypoint"):
            return 0, harness_output({"ok": False, "stage": stage, "error": error}), ""
        results = [{"instance": i["instance"],
                    "problems": [f"{pd_vllm_argcheck.where(i)}: vLLM's serve parser rejects it: {error}"]}
                   for i in json.loads(data)["instances"]]
        return 0, harness_output({"ok": True, "version": "0.32.0", "results": results}), ""
    return fake


@pytest.fixture
def env(tmp_path, local_inv):
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    for d in ("units", "etc-vllm", "state"):
        (tmp_path / d).mkdir()
    host = local_inv["hosts"]["pd-prefill-0"]
    args = {
        "instance": host["pd_instances"][0],
        "recipe": local_inv["recipe"],
        "host_address": host["ansible_host"],
        "python": "/opt/vllm/current/bin/python",
        "validate_python": str(py),
        "user": "vllm",
        "group": GROUP,
        "unit_dir": str(tmp_path / "units"),
        "env_dir": str(tmp_path / "etc-vllm"),
        "state_root": str(tmp_path / "state"),
    }
    return {"args": args, "tmp": tmp_path}


def unit_file(env):
    return env["tmp"] / "units" / "vllm-prefill-0.service"


def env_file(env):
    return env["tmp"] / "etc-vllm" / "prefill-0.env"


def test_first_run_writes_then_second_run_is_unchanged(env, monkeypatch):
    calls = []
    res, failed = run_module(vllm_instance.main, env["args"], run_command=ok_parser(calls), monkeypatch=monkeypatch)
    assert not failed, res
    assert res["changed"] and res["restart_required"] and res["created"] and res["flags_validated"]
    assert res["unit_name"] == "vllm-prefill-0.service"
    assert res["vllm_version"] == "0.32.0"
    # the parser saw exactly the argv the unit runs
    assert calls[0]["argv"] == res["argv"]
    assert calls[0]["args"][-3] == env["args"]["validate_python"]
    # one harness: deploy runs the code validate.yml runs (pd_vllm_argv_check), with this instance's pool
    assert calls[0]["args"][-2:] == ["-c", pd_vllm_argcheck.harness_source()]
    assert calls[0]["instances"] == [{"instance": "prefill-0", "pool": "prefill", "argv": res["argv"]}]
    assert unit_file(env).read_text().count("--port 8100") == 1
    mode = stat.S_IMODE(os.stat(env_file(env)).st_mode)
    assert mode == 0o640
    assert os.stat(env_file(env)).st_gid == grp.getgrnam(GROUP).gr_gid
    assert stat.S_IMODE(os.stat(unit_file(env)).st_mode) == 0o644
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT=\"5600\"" in env_file(env).read_text()
    # no temp files left behind
    assert sorted(p.name for p in (env["tmp"] / "units").iterdir()) == ["vllm-prefill-0.service"]
    assert sorted(p.name for p in (env["tmp"] / "etc-vllm").iterdir()) == [".prefill-0.restart-pending",
                                                                           "prefill-0.env",
                                                                           "prefill-0.record.json"]
    Path(res["pending_path"]).unlink()  # what the role does once the instance runs this config
    res2, failed = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed
    assert not res2["changed"] and not res2["restart_required"] and not res2["created"]


def test_validate_cache_skips_the_parser_until_the_argv_or_the_venv_changes(env, monkeypatch):
    sp = env["tmp"] / "venv" / "lib" / "python3.11" / "site-packages"
    (sp / "vllm-0.32.0.dist-info").mkdir(parents=True)
    cache = env["tmp"] / "rollout" / "flags-validated.json"
    args = dict(env["args"], validate_cache=str(cache))
    calls = []
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser(calls), monkeypatch=monkeypatch)
    assert not failed and res["flags_validated"] and not res["flags_validation_cached"] and len(calls) == 1
    assert len(json.loads(cache.read_text())) == 1
    # same argv, same venv: no parser run, still reported as validated by that version
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser(calls), monkeypatch=monkeypatch)
    assert not failed and res["flags_validated"] and res["flags_validation_cached"] and len(calls) == 1
    assert res["vllm_version"] == "0.32.0"
    # another flag: parsed again
    other = dict(args, instance=dict(args["instance"], extra_flags={"max-num-seqs": 8}))
    run_module(vllm_instance.main, other, run_command=ok_parser(calls), monkeypatch=monkeypatch)
    assert len(calls) == 2
    # pip changed the venv (a package replaced): the old entries miss
    (sp / "vllm-0.32.0.dist-info").rename(sp / "vllm-0.33.0.dist-info")
    res, _failed = run_module(vllm_instance.main, args, run_command=ok_parser(calls), monkeypatch=monkeypatch)
    assert len(calls) == 3 and not res["flags_validation_cached"]


def test_the_first_parse_of_a_host_checks_its_other_instances_in_the_same_process(env, local_inv, monkeypatch):
    """validate_with: one vLLM import per host, not per instance. The first instance whose argv must be parsed takes
    the others along; the accepted ones are cached, so their own task parses nothing. A sibling the parser refuses
    is not cached, and its problem is not the first instance's: its own task fails on it."""
    instances = local_inv["hosts"]["pd-prefill-0"]["pd_instances"]
    assert len(instances) == 2, "inventory/local runs two prefill instances on pd-prefill-0"
    cache = env["tmp"] / "flags-validated.json"
    args = dict(env["args"], validate_cache=str(cache), validate_with=instances)
    calls = []
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser(calls), monkeypatch=monkeypatch)
    assert not failed, res
    assert [i["instance"] for i in calls[0]["instances"]] == ["prefill-0", "prefill-1"]
    assert res["flags_validated_with"] == ["prefill-1"] and len(json.loads(cache.read_text())) == 2
    second = dict(args, instance=instances[1])
    res, failed = run_module(vllm_instance.main, second, run_command=ok_parser(calls), monkeypatch=monkeypatch)
    assert not failed and res["flags_validation_cached"] and len(calls) == 1, res
    # a sibling the parser refuses: the first instance passes alone, nothing is cached for the sibling
    cache.unlink()
    bad_sibling = dict(instances[1], extra_flags={"max-num-seqz": 4})

    def refuses_the_sibling(self, cmd, data=None, **kw):
        req = json.loads(data)
        results = [{"instance": i["instance"], "problems": [f"{pd_vllm_argcheck.where(i)}: rejects --max-num-seqz"]
                    if "--max-num-seqz" in i["argv"] else []} for i in req["instances"]]
        return 0, harness_output({"ok": True, "version": "0.32.0", "nixl": "0.7.1", "results": results}), ""

    args = dict(args, validate_with=[instances[0], bad_sibling])
    res, failed = run_module(vllm_instance.main, args, run_command=refuses_the_sibling, monkeypatch=monkeypatch)
    assert not failed and res["flags_validated_with"] == [] and len(json.loads(cache.read_text())) == 1, res
    res, failed = run_module(vllm_instance.main, dict(args, instance=bad_sibling), run_command=refuses_the_sibling,
                             monkeypatch=monkeypatch)
    assert failed and "--max-num-seqz" in res["msg"] and "prefill-1" in res["msg"], res
    # no cache, or check mode: the parser sees this instance alone (a verdict that is not kept is not worth it)
    calls.clear()
    run_module(vllm_instance.main, dict(env["args"], validate_with=instances), run_command=ok_parser(calls),
               monkeypatch=monkeypatch)
    run_module(vllm_instance.main, dict(env["args"], validate_cache=str(env["tmp"] / "c2.json"),
                                        validate_with=instances), check_mode=True, run_command=ok_parser(calls),
               monkeypatch=monkeypatch)
    assert [len(c["instances"]) for c in calls] == [1, 1]


def test_validate_cache_never_records_a_rejection_or_a_check_mode_run(env, monkeypatch):
    cache = env["tmp"] / "flags-validated.json"
    bad = dict(env["args"], validate_cache=str(cache),
               instance=dict(env["args"]["instance"], extra_flags={"max-num-seqz": 4}))
    res, failed = run_module(vllm_instance.main, bad, run_command=rejecting_parser("unrecognized arguments"),
                             monkeypatch=monkeypatch)
    assert failed and not cache.exists()
    ok = dict(env["args"], validate_cache=str(cache))
    res, failed = run_module(vllm_instance.main, ok, check_mode=True, run_command=ok_parser([]),
                             monkeypatch=monkeypatch)
    assert not failed and not cache.exists()
    cache.write_text("{not json")  # damaged: validated again and rewritten
    res, failed = run_module(vllm_instance.main, ok, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed and not res["flags_validation_cached"] and len(json.loads(cache.read_text())) == 1


def test_parser_rejection_fails_naming_flag_and_writes_nothing(env, monkeypatch):
    args = dict(env["args"])
    args["instance"] = dict(args["instance"], extra_flags={"max-num-seqz": 4})
    res, failed = run_module(
        vllm_instance.main, args,
        run_command=rejecting_parser("unrecognized arguments: --max-num-seqz 4"), monkeypatch=monkeypatch,
    )
    assert failed
    assert "--max-num-seqz" in res["msg"] and "prefill-0" in res["msg"] and "nothing was written" in res["msg"]
    assert not unit_file(env).exists() and not env_file(env).exists()


def test_import_failure_is_not_treated_as_valid(env, monkeypatch):
    res, failed = run_module(
        vllm_instance.main, env["args"],
        run_command=rejecting_parser("ModuleNotFoundError: No module named 'vllm'", stage="import"),
        monkeypatch=monkeypatch,
    )
    assert failed and "cannot import" in res["msg"]
    assert not unit_file(env).exists()


def test_garbage_output_fails(env, monkeypatch):
    def fake(self, args, data=None, **kw):
        return 1, "", "Segmentation fault"
    res, failed = run_module(vllm_instance.main, env["args"], run_command=fake, monkeypatch=monkeypatch)
    assert failed and "Segmentation fault" in res["msg"]
    assert not unit_file(env).exists()


def test_missing_python_warns_and_skips_only_that_check(env, monkeypatch):
    args = dict(env["args"], validate_python=str(env["tmp"] / "nope" / "python"))

    def never(self, *a, **kw):
        raise AssertionError("run_command must not be called when the python is absent")
    res, failed = run_module(vllm_instance.main, args, run_command=never, monkeypatch=monkeypatch)
    assert not failed, res
    assert res["flags_validated"] is False and res["changed"]
    assert unit_file(env).exists()


def test_check_mode_writes_nothing_and_reports_diff(env, monkeypatch):
    res, failed = run_module(vllm_instance.main, env["args"], check_mode=True, diff=True,
                             run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed
    assert res["changed"] and res["restart_required"]
    assert not unit_file(env).exists() and not env_file(env).exists()
    after = {d["after_header"]: d for d in res["diff"]}
    assert after[str(unit_file(env))]["before"] == "" and "ExecStart=" in after[str(unit_file(env))]["after"]
    assert str(env_file(env)) in after


def test_restart_required_semantics(env, monkeypatch):
    res, _failed = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    Path(res["pending_path"]).unlink()
    # permission drift: changed, but the running process config is the same -> no restart
    os.chmod(env_file(env), 0o644)
    res, _failed = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert res["changed"] and not res["restart_required"]
    assert stat.S_IMODE(os.stat(env_file(env)).st_mode) == 0o640
    # env-only change -> restart
    args = dict(env["args"])
    args["instance"] = dict(args["instance"], extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    res, _failed = run_module(vllm_instance.main, args, diff=True, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert res["changed"] and res["restart_required"]
    Path(res["pending_path"]).unlink()
    assert [d["after_header"] for d in res["diff"]] == [str(env_file(env))]
    assert "+VLLM_CPU_OMP_THREADS_BIND" not in res["diff"][0]["before"]
    # flag change -> restart, unit diff shows old and new
    args["instance"] = dict(args["instance"], extra_flags={"max-num-seqs": 8})
    res, _failed = run_module(vllm_instance.main, args, diff=True, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert res["restart_required"]
    d = next(d for d in res["diff"] if d["after_header"] == str(unit_file(env)))
    assert "--max-num-seqs" not in d["before"] and "--max-num-seqs 8" in d["after"]


def test_restart_owed_by_a_failed_run_survives(env, monkeypatch):
    res, _failed = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    marker = Path(res["pending_path"])
    assert marker.parent == env["tmp"] / "etc-vllm" and marker.exists()
    # the play died before the restart: the next run, with nothing to write, still owes the restart
    res, _failed = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not res["changed"] and res["restart_required"]
    # the role removes the marker once the instance runs the new config
    marker.unlink()
    res, _failed = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not res["changed"] and not res["restart_required"]


def test_bad_input_fails_before_writing(env, monkeypatch):
    args = dict(env["args"])
    args["instance"] = dict(args["instance"], pool="prefil")
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert failed and "instance prefill-0, field pool" in res["msg"]
    assert not unit_file(env).exists()


def test_unit_runs_vllm_serve_and_reports_the_api_server_count(env, monkeypatch):
    calls = []
    args = dict(env["args"], instance=dict(env["args"]["instance"], dp_size=2, dp_rpc_port=13345))
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser(calls), monkeypatch=monkeypatch)
    assert not failed, res
    # vllm_package defaults to the CUDA build's distribution: its console script, the model as positional argument
    assert res["command"] == ["/opt/vllm/current/bin/vllm", "serve"]
    assert res["argv"][0] == args["recipe"]["pd_model_path"] and "--model" not in res["argv"]
    assert "ExecStart=/opt/vllm/current/bin/vllm serve " + res["argv"][0] + " \\" in unit_file(env).read_text()
    assert calls[0]["subcommand"] == "serve" and calls[0]["argv"] == res["argv"]
    assert res["api_server_count"] == 2  # vLLM's default with the internal LB: the DP size
    args["instance"]["extra_flags"] = {"api-server-count": 1}
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed and res["api_server_count"] == 1 and "--api-server-count" in res["argv"]


def test_cpu_build_runs_the_launcher_module(env, monkeypatch):
    args = dict(env["args"], vllm_package="vllm-cpu")
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed, res
    assert res["command"] == ["/opt/vllm/current/bin/python", "-m", "pd_vllm_cli", "serve"]
    assert "ExecStart=/opt/vllm/current/bin/python -m pd_vllm_cli serve /" in unit_file(env).read_text()


def test_unknown_vllm_package_fails_before_writing(env, monkeypatch):
    args = dict(env["args"], vllm_package="vllm-tpu")
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert failed and "instance prefill-0, field pd_vllm_package: 'vllm-tpu'" in res["msg"], res
    assert not unit_file(env).exists()


def test_entry_point_is_checked_only_in_the_units_own_venv(env, monkeypatch):
    calls = []
    # a review render: another vLLM parses the flags, the unit's venv is elsewhere -> no entry point check
    res, failed = run_module(vllm_instance.main, env["args"], run_command=ok_parser(calls), monkeypatch=monkeypatch)
    assert not failed and calls[0]["entry"] == {} and not res["entry_point_checked"]
    own = env["args"]["validate_python"]
    for package, entry in (("vllm-cpu", {"module": "pd_vllm_cli"}),):
        calls.clear()
        args = dict(env["args"], python=own, vllm_package=package)
        res, failed = run_module(vllm_instance.main, args, run_command=ok_parser(calls), monkeypatch=monkeypatch)
        assert not failed and calls[0]["entry"] == entry and res["entry_point_checked"], res
    # the console script form needs <venv>/bin/vllm: missing -> fail before the parser runs, nothing written
    for f in (unit_file(env), env_file(env)):
        f.unlink()
    calls.clear()
    args = dict(env["args"], python=own, vllm_package="vllm")
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser(calls), monkeypatch=monkeypatch)
    assert failed and "bin/vllm, which does not exist" in res["msg"] and "pd_vllm_package" in res["msg"], res
    assert not calls and not unit_file(env).exists()
    (Path(own).parent / "vllm").write_text("#!/bin/sh\n")
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser(calls), monkeypatch=monkeypatch)
    assert not failed and calls[0]["entry"] == {"console_script": "vllm"}, res


def test_entry_point_rejection_fails_naming_pd_vllm_package(env, monkeypatch):
    args = dict(env["args"], python=env["args"]["validate_python"], vllm_package="vllm-cpu")
    res, failed = run_module(vllm_instance.main, args, monkeypatch=monkeypatch, run_command=rejecting_parser(
        "the module pd_vllm_cli is not installed in this venv", stage="entrypoint"))
    assert failed and "cannot start" in res["msg"] and "pd_vllm_cli is not installed" in res["msg"], res
    assert "pd_vllm_package" in res["msg"] and "vllm_install" in res["msg"]
    assert not unit_file(env).exists()


def test_render_root(env, monkeypatch):
    root = env["tmp"] / "render"
    args = dict(env["args"], render_root=str(root), unit_dir="/etc/systemd/system", env_dir="/etc/vllm",
                state_root="/var/lib/vllm", group="vllm-does-not-exist-here")
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed, res
    assert Path(res["unit_path"]) == root / "etc/systemd/system/vllm-prefill-0.service"
    assert (root / "etc/vllm/prefill-0.env").is_file()
    assert "WorkingDirectory=/var/lib/vllm/prefill-0" in Path(res["unit_path"]).read_text()


# ---- the real vLLM argument parser of the installed version -------------------------------------------------

def real_run_command(self, args, data=None, environ_update=None, **kw):
    proc = subprocess.run(args, input=data, capture_output=True, text=True, timeout=600, check=False,
                          env=dict(os.environ, **(environ_update or {})))
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def real_env(env):
    need_vllm_venv()
    env["args"]["validate_python"] = str(VLLM_VENV_PY)
    return env


def test_real_parser_rejects_typo_flag_end_to_end(real_env, monkeypatch):
    args = dict(real_env["args"])
    args["instance"] = dict(args["instance"], extra_flags={"max-num-seqz": 4})
    res, failed = run_module(vllm_instance.main, args, run_command=real_run_command, monkeypatch=monkeypatch)
    assert failed, res
    assert "--max-num-seqz" in res["msg"] and "rejects the flags" in res["msg"]
    assert not unit_file(real_env).exists() and not env_file(real_env).exists()


def test_real_parser_refuses_an_abbreviated_flag_at_deploy_as_validate_does(real_env, monkeypatch):
    """argparse (allow_abbrev) would read --max-model as --max-model-len and vLLM would start with it; validate.yml's
    pd_vllm_argv_check refuses the abbreviation, and so must the deploy-time check, which runs the same harness."""
    args = dict(real_env["args"])
    args["instance"] = dict(args["instance"], extra_flags={"max-model": 2048})
    res, failed = run_module(vllm_instance.main, args, run_command=real_run_command, monkeypatch=monkeypatch)
    assert failed, res
    assert "instance prefill-0, flag --max-model: not an option of `vllm serve`" in res["msg"], res["msg"]
    assert "silently read it as --max-model-len" in res["msg"] and "rejects the flags" in res["msg"]
    assert not unit_file(real_env).exists() and not env_file(real_env).exists()


class _Module:
    """Just what pd_vllm_argcheck.run_check needs, with the real subprocess."""

    def get_bin_path(self, name):
        return None

    run_command = real_run_command


def _items(inventory):
    """{name: the harness's input for that instance}, as vllm_instance sends it."""
    from ansible_collections.b300.pd.plugins.module_utils import pd_recipe
    inv = load_inventory(inventory)
    return {i["name"]: {"instance": i["name"], "pool": i["pool"], "argv": pd_recipe.build_argv(inv["recipe"], i)}
            for hv in inv["hosts"].values() for i in hv["pd_instances"]}


def _without(argv, flag):
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


@pytest.fixture(scope="module")
def batch():
    """One vLLM process parses every case (importing vLLM takes ~15 s of CPU, a minute on a busy machine)."""
    need_vllm_venv()
    local = _items("local")
    base = local["prefill-0"]
    cases = {f"local:{k}": v for k, v in local.items()}
    # b300's GPU flags too: the CUDA build of the same release shares this parser.
    cases.update({f"b300:{k}": v for k, v in _items("b300").items()})
    argv = base["argv"]
    cases["typo"] = dict(base, argv=[*argv, "--max-num-seqz", "4"])
    cases["bad-json:speculative-config"] = dict(base, argv=[*argv, "--speculative-config", "{method: mtp"])
    cases["bad-json:compilation-config"] = dict(base, argv=[*argv, "--compilation-config", '{"cudagraph_mode": FULL}'])
    cases["bad-json:kv-transfer-config"] = dict(base, argv=[*_without(argv, "--kv-transfer-config"),
                                                            "--kv-transfer-config", "{kv_connector: Nixl"])
    report, rc, output = pd_vllm_argcheck.run_check(_Module(), str(VLLM_VENV_PY), list(cases.values()),
                                                    subcommand="serve", timeout=900)
    assert report is not None and report["ok"], (rc, output, report)
    return dict(zip(cases, report["results"], strict=True))


@pytest.mark.parametrize("name", ["prefill-0", "prefill-1", "decode-0"])
def test_real_parser_accepts_every_local_instance(batch, name):
    assert batch[f"local:{name}"]["problems"] == [], batch[f"local:{name}"]


@pytest.mark.parametrize("name", ["prefill-a", "prefill-b", "prefill-c", "prefill-d", "decode-a"])
def test_real_parser_accepts_every_b300_instance(batch, name):
    assert batch[f"b300:{name}"]["problems"] == [], batch[f"b300:{name}"]


def test_real_parser_rejects_typo(batch):
    problems = batch["typo"]["problems"]
    assert problems and "--max-num-seqz" in " ".join(problems), problems


@pytest.mark.parametrize("flag", ["speculative-config", "compilation-config", "kv-transfer-config"])
def test_real_parser_rejects_bad_json(batch, flag):
    r = batch[f"bad-json:{flag}"]
    assert r["problems"] and f"--{flag}" in " ".join(r["problems"]), r


@pytest.fixture
def served(env):
    """A model root as role model_weights leaves it: revisions/<rev>/ and the served symlink to one of them."""
    root = env["tmp"] / "models"
    for rev in ("rev1", "rev2"):
        (root / "revisions" / rev).mkdir(parents=True)
    link = root / "tiny-pd"
    link.symlink_to("revisions/rev1")
    # The unit's own venv (python is validate_python): the versions go into the record.
    args = dict(env["args"], recipe=dict(env["args"]["recipe"], pd_model_path=str(link)),
                python=env["args"]["validate_python"], vllm_package="vllm-cpu")
    return {"args": args, "root": root, "link": link}


def _switch(link, rev):
    tmp = link.with_name(link.name + ".tmp")
    tmp.symlink_to(f"revisions/{rev}")
    tmp.replace(link)


def test_record_pins_the_revision_and_keeps_the_running_state_for_rollback(env, served, monkeypatch):
    args, root = served["args"], served["root"]
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed, res
    rec = json.loads(Path(res["record_path"]).read_text())
    assert rec == res["record"]
    # the unit loads the revision directory, not the symlink: switching the symlink alone changes no running unit
    assert rec["model_path"] == str(root / "revisions" / "rev1") and rec["argv"][0] == rec["model_path"]
    assert rec["model_revision"] == "rev1"
    assert f"serve {root}/revisions/rev1" in unit_file(env).read_text()
    assert (rec["vllm_version"], rec["nixl_version"]) == ("0.32.0", "0.7.1")
    assert rec["compat_key"].startswith("vllm=0.32.0;nixl=0.7.1;flags=")
    assert rec["api_server_count"] == res["api_server_count"] and rec["pool"] == "prefill"
    assert res["running_record"] is None  # nothing ran before
    Path(res["pending_path"]).unlink()
    unit_v1, rec_v1 = unit_file(env).read_text(), Path(res["record_path"]).read_text()

    _switch(served["link"], "rev2")
    res, _failed = run_module(vllm_instance.main, args, diff=True, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert res["restart_required"] and res["record"]["model_revision"] == "rev2"
    assert res["record"]["compat_key"] != json.loads(rec_v1)["compat_key"]  # never paired across revisions
    assert res["running_record"]["model_revision"] == "rev1"
    rollback = Path(res["rollback_dir"])
    assert (rollback / "prefill-0.service").read_text() == unit_v1
    assert (rollback / "prefill-0.record.json").read_text() == rec_v1
    assert (rollback / "prefill-0.env").read_text() == env_file(env).read_text()  # env did not change
    # what a rollback copies back (role pd_rollout composes no path): each saved copy onto its live file
    back = {Path(f["saved"]): Path(f["dest"]) for f in res["rollback_files"]}
    assert back == {rollback / "prefill-0.service": unit_file(env), rollback / "prefill-0.env": env_file(env),
                    rollback / "prefill-0.record.json": Path(res["record_path"])}
    assert {f["dest"]: (f["mode"], f["group"]) for f in res["rollback_files"]}[str(env_file(env))][0] == "0640"
    assert all(Path(f["saved"]).exists() for f in res["rollback_files"])

    # a second run before the restart (the first play failed): the rollback target stays what RUNS (rev1)
    _switch(served["link"], "rev1")
    args2 = dict(args, instance=dict(args["instance"], extra_flags={"max-num-seqs": 8}))
    res, _failed = run_module(vllm_instance.main, args2, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert res["restart_required"] and res["running_record"]["model_revision"] == "rev1"
    assert (rollback / "prefill-0.service").read_text() == unit_v1


def test_reverting_a_change_whose_restart_never_came_owes_no_restart(env, served, monkeypatch):
    """A change written, its restart failed (pending marker left), the inventory reverted: the render equals what
    the process runs (the saved previous state), so the files go back and no restart is owed."""
    args = served["args"]
    res, _failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    Path(res["pending_path"]).unlink()  # v1 runs
    unit_v1 = unit_file(env).read_text()
    changed = dict(args, instance=dict(args["instance"], extra_flags={"max-num-seqs": 8}))
    res, _failed = run_module(vllm_instance.main, changed, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert res["restart_required"] and Path(res["pending_path"]).exists()  # v2 written, restart owed

    res, failed = run_module(vllm_instance.main, args, diff=True, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed, res
    assert res["back_to_running"] and res["changed"] and not res["restart_required"]
    assert unit_file(env).read_text() == unit_v1 and not Path(res["pending_path"]).exists()
    res, _failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not res["changed"] and not res["restart_required"] and not res["back_to_running"]

    # a third state while v2 is pending is still a change of what runs (v1): restart owed
    run_module(vllm_instance.main, changed, run_command=ok_parser([]), monkeypatch=monkeypatch)
    third = dict(args, instance=dict(args["instance"], extra_flags={"max-num-seqs": 4}))
    res, _failed = run_module(vllm_instance.main, third, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert res["restart_required"] and not res["back_to_running"] and Path(res["pending_path"]).exists()


def test_compat_key_pairs_prefill_and_decode_of_one_revision_only(env, served, monkeypatch):
    args = served["args"]
    dec_inst = dict(args["instance"], name="decode-0", pool="decode", http_port=8200, nixl_side_channel_port=5700)
    keys = {}
    for rev in ("rev1", "rev2"):
        _switch(served["link"], rev)
        for inst in (args["instance"], dec_inst):
            res, failed = run_module(vllm_instance.main, dict(args, instance=inst), check_mode=True,
                                     run_command=ok_parser([]), monkeypatch=monkeypatch)
            assert not failed, res
            keys[(rev, inst["pool"])] = res["record"]["compat_key"]
    assert keys[("rev1", "prefill")] == keys[("rev1", "decode")]
    assert keys[("rev2", "prefill")] == keys[("rev2", "decode")]
    assert keys[("rev1", "prefill")] != keys[("rev2", "prefill")]


def test_render_root_does_not_resolve_the_served_symlink(env, served, monkeypatch):
    args = dict(served["args"], render_root=str(env["tmp"] / "render"), validate_flags=False)
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed, res
    assert res["record"]["model_path"] == str(served["link"]) and res["record"]["model_revision"] is None


def _plugin(site: Path, module: str, source: str) -> None:
    """A vLLM plugin installed as role vllm_install does: the module and a dist-info with its entry point."""
    (site / f"{module}.py").write_text(source)
    dist = site / f"{module}-1.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{module} = {module}:register\n")


def test_a_change_of_plugin_code_changes_the_record_and_owes_a_restart(env, monkeypatch):
    # 2026-12-06: a new roles/vllm_install/files/pd_*.py reached the venv, but no record changed, so the engines
    # ran the old plugin code until their next restart
    venv = env["tmp"] / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    _plugin(site, "pd_shm_notify", "def register():\n    pass\n")
    other = site / "numpy-2.0.dist-info"
    other.mkdir()
    (other / "entry_points.txt").write_text("[console_scripts]\nf2py = numpy.f2py.f2py2e:main\n")
    args = dict(env["args"], python=str(venv / "bin" / "python"), vllm_package="vllm-cpu")
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed, res
    first = res["record"]["plugins"]
    assert list(first) == ["pd_shm_notify"] and len(first["pd_shm_notify"]) == 16
    Path(res["pending_path"]).unlink()
    res, _failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not res["changed"] and not res["restart_required"]  # same code: nothing to do
    _plugin(site, "pd_shm_notify", "def register():\n    return 1\n")
    res, _failed = run_module(vllm_instance.main, args, diff=True, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert res["changed"] and res["restart_required"]
    assert res["record"]["plugins"]["pd_shm_notify"] != first["pd_shm_notify"]
    assert [d["after_header"] for d in res["diff"]] == [res["record_path"]]  # only the record: unit and env same
    assert res["running_record"]["plugins"] == first  # what runs until the restart
    # a plugin whose module is gone says so (vLLM would fail to load it)
    (site / "pd_shm_notify.py").unlink()
    assert plugin_digests(str(venv)) == {"pd_shm_notify": "missing"}


# ---- the workers' API key (issue 32): VLLM_API_KEY from its own 0640 file, never argv/unit/record/diff/result -----

KEY = "k3y-" + "9f" * 30


def _everything_but_the_key_file(env):
    return {p.name: p.read_text() for d in ("units", "etc-vllm") for p in (env["tmp"] / d).rglob("*")
            if p.is_file() and p.name != "api-key.env"}


def test_api_key_reaches_vllm_only_through_its_own_env_file(env, monkeypatch):
    args = dict(env["args"], api_key=KEY, requires_units=["pd-firewall.service"])
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch, diff=True)
    assert not failed, res
    key_file = env["tmp"] / "etc-vllm" / "api-key.env"
    assert res["api_key_path"] == str(key_file)
    assert key_file.read_text().splitlines()[1] == f'VLLM_API_KEY="{KEY}"'
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o640
    assert os.stat(key_file).st_gid == grp.getgrnam(GROUP).gr_gid
    unit = unit_file(env).read_text()
    # the unit loads it (no "-": a missing key file stops the unit instead of serving /v1 open) after the env file
    assert unit.index(f"EnvironmentFile={env['tmp']}/etc-vllm/prefill-0.env\n") < unit.index(
        f"EnvironmentFile={key_file}\n")
    assert "Requires=pd-firewall.service\nAfter=pd-firewall.service\n" in unit
    # nowhere else: argv, unit, env file, record, the result (diff included: run_module does not mask no_log values)
    assert KEY not in json.dumps(res)
    assert all(KEY not in text for text in _everything_but_the_key_file(env).values())
    assert "--api-key" not in res["argv"]
    digest = res["record"]["api_key_digest"]
    assert len(digest) == 16 and digest not in KEY
    # same key: nothing changes; another key: the record changes, so the instance restarts (drain path)
    Path(res["pending_path"]).unlink()
    res2, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed and not res2["changed"] and not res2["restart_required"]
    res3, failed = run_module(vllm_instance.main, dict(args, api_key=KEY + "x"), run_command=ok_parser([]),
                              monkeypatch=monkeypatch, diff=True)
    assert not failed and res3["changed"] and res3["restart_required"]
    assert res3["record"]["api_key_digest"] != digest
    assert KEY not in json.dumps(res3) and f'"{KEY}x"' in key_file.read_text()
    # the rollback copies hold no key either
    rollback = env["tmp"] / "etc-vllm" / "rollback"
    assert rollback.is_dir() and all(KEY not in p.read_text() for p in rollback.iterdir())


def test_api_key_file_is_not_written_in_check_mode_nor_in_a_review_render(env, monkeypatch):
    res, failed = run_module(vllm_instance.main, dict(env["args"], api_key=KEY), run_command=ok_parser([]),
                             monkeypatch=monkeypatch, check_mode=True)
    assert not failed and res["changed"]
    assert not (env["tmp"] / "etc-vllm" / "api-key.env").exists()
    root = env["tmp"] / "render"
    args = dict(env["args"], api_key=KEY, render_root=str(root), unit_dir="/etc/systemd/system",
                env_dir="/etc/vllm", state_root="/var/lib/vllm", group="vllm-does-not-exist-here")
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed, res
    assert "EnvironmentFile=/etc/vllm/api-key.env\n" in Path(res["unit_path"]).read_text()
    assert not (root / "etc/vllm/api-key.env").exists()
    assert all(KEY not in p.read_text() for p in root.rglob("*") if p.is_file())


def test_no_api_key_removes_the_key_file_and_the_unit_line(env, monkeypatch):
    res, failed = run_module(vllm_instance.main, dict(env["args"], api_key=KEY), run_command=ok_parser([]),
                             monkeypatch=monkeypatch)
    assert not failed and (env["tmp"] / "etc-vllm" / "api-key.env").exists()
    res, failed = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed and res["changed"] and res["api_key_path"] is None
    assert not (env["tmp"] / "etc-vllm" / "api-key.env").exists()
    assert "api-key.env" not in unit_file(env).read_text()
    assert "api_key_digest" not in res["record"]


@pytest.mark.parametrize("where, value", [
    ("extra_flags", {"api-key": KEY}),
    ("extra_flags", {"api_key": KEY}),
    ("extra_flags", {"api-ke": KEY}),
    ("pd_vllm_flags_common", {"api-key": KEY}),
    ("extra_env", {"VLLM_API_KEY": KEY}),
    ("pd_vllm_env", {"VLLM_API_KEY": KEY}),
])
def test_api_key_in_flags_or_env_is_refused_with_the_fix(env, monkeypatch, where, value):
    args = dict(env["args"])
    if where.startswith("pd_"):
        args["recipe"] = dict(args["recipe"], **{where: {**(args["recipe"].get(where) or {}), **value}})
    else:
        args["instance"] = dict(args["instance"], **{where: value})
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert failed and "pd_router_api_key" in res["msg"] and where in res["msg"], res["msg"]
    assert KEY not in res["msg"]
    assert not unit_file(env).exists() and not env_file(env).exists()


@pytest.mark.parametrize("key", ["\t", "two words ", "new\nline", "nul\x00"])
def test_bad_api_key_is_refused_without_echoing_it(env, monkeypatch, key):
    res, failed = run_module(vllm_instance.main, dict(env["args"], api_key=key + KEY), run_command=ok_parser([]),
                             monkeypatch=monkeypatch)
    assert failed and "pd_router_api_key" in res["msg"] and KEY not in res["msg"]
    assert not unit_file(env).exists()


# ---- every inventory string checked where it is written (issue 32, item 4) ------------------------------------

@pytest.mark.parametrize("name", ["../x", "a/b", "a b", "a\nb", ".hidden"])
def test_instance_name_is_checked_by_the_writer(env, monkeypatch, name):
    args = dict(env["args"], instance=dict(env["args"]["instance"], name=name))
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert failed and "pd_instances[].name" in res["msg"], res
    assert list((env["tmp"] / "etc-vllm").iterdir()) == [] and list((env["tmp"] / "units").iterdir()) == []


def test_writable_path_with_a_space_is_refused_by_the_writer(env, monkeypatch):
    args = dict(env["args"], instance=dict(env["args"]["instance"], extra_env={"TMPDIR": "/srv/x /etc"}))
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert failed and "extra_env.TMPDIR" in res["msg"] and "plain absolute path" in res["msg"], res
    assert not unit_file(env).exists()


def test_served_model_name_with_a_newline_is_refused_by_the_writer(env, monkeypatch):
    args = dict(env["args"], recipe=dict(env["args"]["recipe"], pd_served_model_name="m\nExecStartPre=/bin/x"))
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert failed and "pd_served_model_name" in res["msg"] and "U+000A" in res["msg"], res
    assert not unit_file(env).exists()


def test_requires_units_are_checked(env, monkeypatch):
    args = dict(env["args"], requires_units=["pd-firewall.service\nExecStartPre=/bin/sh"])
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert failed and "requires_units[0]" in res["msg"], res
    assert not unit_file(env).exists()


# The pinned vLLM's own middleware setup (vllm/entrypoints/serve/middleware/register.py) on an app with a /v1 and a
# /health route, VLLM_API_KEY from the environment the unit's key file gives, no --api-key: /v1 needs the key.
AUTH_SCRIPT = r"""
import json, os
from argparse import Namespace
from fastapi import FastAPI
from starlette.testclient import TestClient
from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
app = FastAPI()
app.get("/v1/models")(lambda: {"data": []})
app.get("/health")(lambda: {})
app.get("/metrics")(lambda: {})
args = Namespace(allowed_origins=["*"], allow_credentials=False, allowed_methods=["*"], allowed_headers=["*"],
                 api_key=None, enable_request_id_headers=False, middleware=[])
init_entrypoints_middleware(args, app, ())
c = TestClient(app)
key = os.environ["VLLM_API_KEY"]
print("PD_TEST_RESULT " + json.dumps({
    "no_key": c.get("/v1/models").status_code,
    "wrong_key": c.get("/v1/models", headers={"Authorization": "Bearer " + key[:-1]}).status_code,
    "key": c.get("/v1/models", headers={"Authorization": "Bearer " + key}).status_code,
    "health": c.get("/health").status_code, "metrics": c.get("/metrics").status_code}))
"""


def test_the_key_file_makes_the_pinned_vllm_require_the_key_on_v1_only(env, monkeypatch):
    need_vllm_venv()
    res, failed = run_module(vllm_instance.main, dict(env["args"], api_key=KEY), run_command=ok_parser([]),
                             monkeypatch=monkeypatch)
    assert not failed, res
    # what systemd's EnvironmentFile= gives the process: the one assignment, its double quotes removed
    (line,) = [x for x in Path(res["api_key_path"]).read_text().splitlines() if not x.startswith("#")]
    name, _eq, quoted = line.partition("=")
    assert name == "VLLM_API_KEY" and quoted.startswith('"') and quoted.endswith('"')
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    proc = subprocess.run([str(VLLM_VENV_PY), "-c", AUTH_SCRIPT], capture_output=True, text=True, timeout=300,
                          check=False, env=dict(environ, VLLM_API_KEY=quoted[1:-1], VLLM_LOGGING_LEVEL="ERROR"))
    out = [x for x in proc.stdout.splitlines() if x.startswith("PD_TEST_RESULT ")]
    assert out, proc.stdout[-2000:] + proc.stderr[-2000:]
    codes = json.loads(out[-1].split(" ", 1)[1])
    assert codes == {"no_key": 401, "wrong_key": 401, "key": 200, "health": 200, "metrics": 200}, codes
