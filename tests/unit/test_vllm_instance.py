"""library/vllm_instance.py: validation gate, atomic writes, check mode, diff, idempotence, restart_required.

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
from conftest import ROOT, load_inventory, load_library, run_module

vllm_instance = load_library("vllm_instance")

VLLM_VENV_PY = ROOT / ".cache" / "vllm-venv" / "bin" / "python"
GROUP = grp.getgrgid(os.getgid()).gr_name


def ok_parser(calls):
    def fake(self, args, data=None, **kw):
        calls.append({"args": args, "argv": json.loads(data)})
        return 0, 'INFO noise\nPD_VLLM_ARGCHECK {"ok": true, "version": "0.32.0"}\n', ""
    return fake


def rejecting_parser(error, stage="parse"):
    def fake(self, args, data=None, **kw):
        out = "PD_VLLM_ARGCHECK " + json.dumps({"ok": False, "stage": stage, "error": error, "version": "0.32.0"})
        return 0, out + "\n", ""
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
    assert unit_file(env).read_text().count("--port 8100") == 1
    mode = stat.S_IMODE(os.stat(env_file(env)).st_mode)
    assert mode == 0o640
    assert os.stat(env_file(env)).st_gid == grp.getgrnam(GROUP).gr_gid
    assert stat.S_IMODE(os.stat(unit_file(env)).st_mode) == 0o644
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT=\"5600\"" in env_file(env).read_text()
    # no temp files left behind
    assert sorted(p.name for p in (env["tmp"] / "units").iterdir()) == ["vllm-prefill-0.service"]
    assert sorted(p.name for p in (env["tmp"] / "etc-vllm").iterdir()) == [".prefill-0.restart-pending",
                                                                           "prefill-0.env"]
    Path(res["pending_path"]).unlink()  # what the role does once the instance runs this config
    res2, failed = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not failed
    assert not res2["changed"] and not res2["restart_required"] and not res2["created"]


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
    res, _ = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    Path(res["pending_path"]).unlink()
    # permission drift: changed, but the running process config is the same -> no restart
    os.chmod(env_file(env), 0o644)
    res, _ = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert res["changed"] and not res["restart_required"]
    assert stat.S_IMODE(os.stat(env_file(env)).st_mode) == 0o640
    # env-only change -> restart
    args = dict(env["args"])
    args["instance"] = dict(args["instance"], extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    res, _ = run_module(vllm_instance.main, args, diff=True, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert res["changed"] and res["restart_required"]
    Path(res["pending_path"]).unlink()
    assert [d["after_header"] for d in res["diff"]] == [str(env_file(env))]
    assert "+VLLM_CPU_OMP_THREADS_BIND" not in res["diff"][0]["before"]
    # flag change -> restart, unit diff shows old and new
    args["instance"] = dict(args["instance"], extra_flags={"max-num-seqs": 8})
    res, _ = run_module(vllm_instance.main, args, diff=True, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert res["restart_required"]
    d = next(d for d in res["diff"] if d["after_header"] == str(unit_file(env)))
    assert "--max-num-seqs" not in d["before"] and "--max-num-seqs 8" in d["after"]


def test_restart_owed_by_a_failed_run_survives(env, monkeypatch):
    res, _ = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    marker = Path(res["pending_path"])
    assert marker.parent == env["tmp"] / "etc-vllm" and marker.exists()
    # the play died before the restart: the next run, with nothing to write, still owes the restart
    res, _ = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not res["changed"] and res["restart_required"]
    # the role removes the marker once the instance runs the new config
    marker.unlink()
    res, _ = run_module(vllm_instance.main, env["args"], run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert not res["changed"] and not res["restart_required"]


def test_bad_input_fails_before_writing(env, monkeypatch):
    args = dict(env["args"])
    args["instance"] = dict(args["instance"], pool="prefil")
    res, failed = run_module(vllm_instance.main, args, run_command=ok_parser([]), monkeypatch=monkeypatch)
    assert failed and "instance prefill-0, field pool" in res["msg"]
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

def _need_venv():
    if VLLM_VENV_PY.exists():
        return
    if os.environ.get("PD_ALLOW_NO_VLLM") == "1":
        pytest.skip(f"{VLLM_VENV_PY} absent and PD_ALLOW_NO_VLLM=1")
    pytest.fail(f"{VLLM_VENV_PY} is missing: run scripts/bootstrap --local (or set PD_ALLOW_NO_VLLM=1 to skip)")


def real_run_command(self, args, data=None, environ_update=None, **kw):
    proc = subprocess.run(args, input=data, capture_output=True, text=True, timeout=600, check=False,
                          env=dict(os.environ, **(environ_update or {})))
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def real_env(env):
    _need_venv()
    env["args"]["validate_python"] = str(VLLM_VENV_PY)
    return env


@pytest.mark.parametrize(("host", "idx"), [("pd-prefill-0", 0), ("pd-prefill-0", 1), ("pd-decode-0", 0)])
def test_real_parser_accepts_local_inventory(real_env, monkeypatch, host, idx):
    inv = load_inventory("local")
    hv = inv["hosts"][host]
    args = dict(real_env["args"], instance=hv["pd_instances"][idx], host_address=hv["ansible_host"])
    res, failed = run_module(vllm_instance.main, args, run_command=real_run_command, monkeypatch=monkeypatch)
    assert not failed, res.get("msg")
    assert res["flags_validated"] is True and res["vllm_version"]


def test_real_parser_rejects_typo_flag(real_env, monkeypatch):
    args = dict(real_env["args"])
    args["instance"] = dict(args["instance"], extra_flags={"max-num-seqz": 4})
    res, failed = run_module(vllm_instance.main, args, run_command=real_run_command, monkeypatch=monkeypatch)
    assert failed, res
    assert "--max-num-seqz" in res["msg"]
    assert not unit_file(real_env).exists()


@pytest.mark.parametrize("flag", ["speculative-config", "compilation-config"])
def test_real_parser_rejects_bad_json(real_env, monkeypatch, flag):
    args = dict(real_env["args"])
    args["instance"] = dict(args["instance"], extra_flags={flag: "{method: mtp"})
    res, failed = run_module(vllm_instance.main, args, run_command=real_run_command, monkeypatch=monkeypatch)
    assert failed, res
    assert f"--{flag}" in res["msg"]
    assert not unit_file(real_env).exists()


def test_real_parser_rejects_bad_kv_transfer_json(real_env, monkeypatch):
    # kv-transfer-config is rendered from a dict, so bad JSON can only come from the raw argv: call the gate directly.
    argv = vllm_instance_argv(real_env) + ["--kv-transfer-config", "{kv_connector: Nixl"]
    module = _FakeModule()
    with pytest.raises(_Fail) as e:
        vllm_instance.validate_with_vllm(module, str(VLLM_VENV_PY), argv, "prefill-0")
    assert "--kv-transfer-config" in str(e.value)


def vllm_instance_argv(env):
    import pd_recipe
    argv = pd_recipe.build_argv(env["args"]["recipe"], env["args"]["instance"])
    i = argv.index("--kv-transfer-config")
    return argv[:i] + argv[i + 2:]


class _Fail(Exception):
    pass


class _FakeModule:
    def warn(self, msg):
        raise AssertionError(msg)

    def get_bin_path(self, name):
        return None

    def run_command(self, args, data=None, environ_update=None, **kw):
        return real_run_command(self, args, data=data, environ_update=environ_update)

    def fail_json(self, msg, **kw):
        raise _Fail(msg)
