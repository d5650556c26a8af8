"""roles/vllm_install's NIXL progress-thread plugin, run against the real NIXL in the vLLM venv.

The plugin must hand NIXL's agent the poll delay from PD_NIXL_PROGRESS_DELAY_US (and the agent must still
work), do nothing when the variable is unset or 0, and wrap only once per process (vLLM loads plugins in
several places). One child process walks through those states: importing NIXL costs seconds here.
Needs .cache/vllm-venv (scripts/bootstrap --local, stage 45): skipped with that reason where it is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".cache" / "vllm-venv" / "bin" / "python"
# scripts/bootstrap.d/45-vllm-venv installs it there, as roles/vllm_install does on the hosts
PLUGIN_SOURCE = ROOT / "roles" / "vllm_install" / "files" / "pd_nixl_progress_delay.py"

CHILD = r"""
import hashlib, json, os, sys
import nixl._api as api
from nixl._api import nixl_agent, nixl_agent_config
import pd_nixl_progress_delay as plugin
original = api.nixlBind
steps = {}
os.environ.pop("PD_NIXL_PROGRESS_DELAY_US", None)
plugin.register()
steps["unset"] = api.nixlBind is original
os.environ["PD_NIXL_PROGRESS_DELAY_US"] = "0"
plugin.register()
steps["zero"] = api.nixlBind is original
os.environ["PD_NIXL_PROGRESS_DELAY_US"] = "1000"
plugin.register()
plugin.register()
steps["set"] = api.nixlBind is original
agent = nixl_agent("plugin-test", nixl_agent_config(num_threads=1))
print(json.dumps({"unchanged": steps, "applied": plugin.applied,
                  "source_sha256": hashlib.sha256(open(plugin.__file__, "rb").read()).hexdigest(),
                  "metadata_bytes": len(agent.get_agent_metadata())}))
"""


@pytest.fixture(scope="module")
def child() -> dict:
    if not VLLM_PY.exists():
        pytest.skip(f"{VLLM_PY} missing: run scripts/bootstrap --local (stage 45-vllm-venv)")
    env = {k: v for k, v in os.environ.items() if k != "PD_NIXL_PROGRESS_DELAY_US"}
    env["UCX_TLS"] = "tcp,self,sm"
    proc = subprocess.run([str(VLLM_PY), "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["source_sha256"] == hashlib.sha256(PLUGIN_SOURCE.read_bytes()).hexdigest(), (
        f"{VLLM_PY}'s {PLUGIN_SOURCE.name} is not the repo's: run scripts/bootstrap --local (stage 45-vllm-venv)")
    return out


def test_unset_or_zero_leaves_nixl_alone(child):
    assert child["unchanged"]["unset"] is True
    assert child["unchanged"]["zero"] is True


def test_delay_reaches_the_real_nixl_agent_once_and_the_agent_works(child):
    assert child["unchanged"]["set"] is False
    # Two register() calls, one agent: a double wrap would count the agent twice.
    assert child["applied"] == {"agents": 1, "delay_us": 1000}
    assert child["metadata_bytes"] > 0
