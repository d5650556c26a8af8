"""Golden test: every b300 instance's rendered ExecStart carries exactly the seed recipe's flags and values.

The seed lines are tests/fixtures/seed/{prefill,decode}.cmd (verbatim copies of the recipe's `vllm serve`
lines). The entry point (`vllm serve`, the console script of b300's venv) and the positional model must be the
seed's; flag order may differ; the only additions allowed are listed in INSTANCE_ADDITIONS.
"""

from __future__ import annotations

import json
import posixpath
import shlex

import pytest
from ansible_collections.b300.pd.plugins.module_utils import pd_recipe, pd_unit
from ansible_collections.b300.pd.tests.unit.pd_testlib import ROOT, load_inventory
from ansible_collections.b300.pd.tests.unit.systemd_exec import exec_start_argv

SEED = ROOT / "tests" / "fixtures" / "seed"
SHORT = {"-ep": "--enable-expert-parallel", "-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size"}
# Per-instance additions of the renderer (architecture.md), not in the seed's single-node command lines.
INSTANCE_ADDITIONS = {"--port", "--served-model-name", "--data-parallel-rpc-port"}
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


def parse_cmdline(words):
    """`[<dir>/]vllm serve MODEL flags` -> ("vllm serve", MODEL, {--flag: value|True}); anything else fails."""
    assert len(words) > 2 and posixpath.basename(words[0]) == "vllm" and words[1] == "serve", words[:4]
    assert not words[2].startswith("-"), f"no positional model: {words[:4]}"
    entry, model, rest = "vllm serve", words[2], words[3:]
    flags, i = {}, 0
    while i < len(rest):
        w = rest[i]
        assert w.startswith("-"), f"stray value {w!r}"
        if "=" in w and w.startswith("--"):
            k, v = w.split("=", 1)
            i += 1
        else:
            k = SHORT.get(w, w)
            if i + 1 < len(rest) and not rest[i + 1].startswith("-"):
                v = rest[i + 1]
                i += 2
            else:
                v = True
                i += 1
        assert k not in flags, f"{k} given twice"
        flags[k] = v
    return entry, model, flags


def same_value(a, b):
    if a is True or b is True:
        return a is b
    for conv in (json.loads, float):
        try:
            return conv(a) == conv(b)
        except (TypeError, ValueError):
            continue
    return a == b


def seed(pool):
    return parse_cmdline(shlex.split((SEED / f"{pool}.cmd").read_text().strip()))[1:]


def test_seed_fixtures_parse_as_expected():
    model, pf = seed("prefill")
    assert model == "/mnt/model/glm/GLM-5.2-NVFP4"
    assert pf["--tensor-parallel-size"] == "1" and pf["--data-parallel-size"] == "4"
    assert pf["--enable-expert-parallel"] is True
    assert json.loads(pf["--kv-transfer-config"])["kv_role"] == "kv_producer"
    _model, df = seed("decode")
    assert df["--data-parallel-size"] == "8" and df["--all2all-backend"] == "flashinfer_nvlink_two_sided"


INV = load_inventory("b300")
PYTHON = "/opt/vllm/current/bin/python"
INSTANCES = [(h, i) for h, hv in INV["hosts"].items() for i in hv["pd_instances"]]


def test_b300_has_the_seed_topology():
    pools = [i["pool"] for _host, i in INSTANCES]
    assert pools.count("prefill") == 4 and pools.count("decode") == 1


@pytest.mark.parametrize(("host", "inst"), INSTANCES, ids=[f"{h}/{i['name']}" for h, i in INSTANCES])
def test_b300_units_render_the_seed_flags(host, inst):
    hv = INV["hosts"][host]
    unit = pd_unit.render_unit(INV["recipe"], inst, PYTHON, "vllm", vllm_package=INV["group_vars"]["pd_vllm_package"])
    words = exec_start_argv(unit)
    entry, model, rendered = parse_cmdline(words)
    seed_model, expected = seed(inst["pool"])
    # the seed's entry point, run from the venv the unit names, and its model as the positional argument
    assert words[:2] == ["/opt/vllm/current/bin/vllm", "serve"] and entry == "vllm serve"
    assert model == seed_model
    # kv-transfer-config: same JSON, and the pool's role
    kv = json.loads(rendered["--kv-transfer-config"])
    assert kv == json.loads(expected["--kv-transfer-config"])
    assert kv["kv_role"] == KV_ROLE[inst["pool"]]
    missing = sorted(set(expected) - set(rendered))
    assert not missing, f"seed flags not rendered: {missing}"
    extra = sorted(set(rendered) - set(expected) - INSTANCE_ADDITIONS)
    assert not extra, f"rendered flags not in the seed: {extra}"
    wrong = {k: (rendered[k], v) for k, v in expected.items() if not same_value(rendered[k], v)}
    assert not wrong, f"values differ (rendered, seed): {wrong}"
    assert rendered["--port"] == str(inst["http_port"])
    assert rendered["--served-model-name"] == INV["recipe"]["pd_served_model_name"]
    assert rendered["--data-parallel-rpc-port"] == str(inst["dp_rpc_port"])
    env = pd_recipe.build_env(INV["recipe"], inst, hv["ansible_host"])
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"  # the seed's `export`
    assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == int(expected["--data-parallel-size"])
    # `vllm serve -dp N` (internal LB) runs N API servers: b300 decode DP8 has 8, each prefill DP4 has 4.
    assert pd_recipe.api_server_count(pd_recipe.build_flags(INV["recipe"], inst), env) == int(
        expected["--data-parallel-size"])


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_golden_entry_point_comparison_can_fail(pool):
    """The old `python -m ...api_server --model MODEL` form, or a missing positional model, is not the seed's."""
    _entry, seed_model, _flags = parse_cmdline(shlex.split((SEED / f"{pool}.cmd").read_text().strip()))
    for words in (
        [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", seed_model, "--port", "8100"],
        ["/opt/vllm/current/bin/vllm", "serve", "--model", seed_model, "--port", "8100"],
        [PYTHON, "-m", "pd_vllm_cli", "serve", seed_model, "--port", "8100"],  # the CPU build's form, not b300's
    ):
        with pytest.raises(AssertionError):
            parse_cmdline(words)


def test_golden_comparison_can_fail():
    """The comparison itself catches a drifted value and an extra flag."""
    _model, expected = seed("decode")
    assert not same_value("0.9", "0.92") and same_value("0.90", "0.9")
    assert not same_value('{"method":"mtp","num_speculative_tokens":1}', '{"method":"mtp","num_speculative_tokens":3}')
    recipe = json.loads(json.dumps(INV["recipe"]))
    recipe["pd_vllm_flags_pool"]["decode"]["max-num-batched-tokens"] = 2048
    decode = next(i for _host, i in INSTANCES if i["pool"] == "decode")
    _entry, _model, rendered = parse_cmdline(exec_start_argv(
        pd_unit.render_unit(recipe, decode, PYTHON, "vllm")))
    assert not same_value(rendered["--max-num-batched-tokens"], expected["--max-num-batched-tokens"])


def test_fixture_is_verbatim_when_seed_is_present():
    src = ROOT.parent / "shared" / "seed" / "glm52-b300-vllm-recipe.txt"
    if not src.exists():
        pytest.skip("no ../shared in this checkout (CI): the fixture copy is what is tested")
    lines = [x for x in src.read_text().splitlines() if x.startswith("vllm serve ")]
    assert [(SEED / f"{p}.cmd").read_text().strip() for p in ("prefill", "decode")] == lines
