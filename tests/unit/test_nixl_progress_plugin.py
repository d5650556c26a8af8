"""roles/vllm_install's NIXL progress-thread plugin, run against the real NIXL in the vLLM venv.

The plugin must hand NIXL's agent the poll delay from PD_NIXL_PROGRESS_DELAY_US (and the agent must still
work), do nothing when the variable is unset or 0, and wrap only once per process (vLLM loads plugins in
several places). One child process walks through those states: importing NIXL costs seconds here.
Needs .cache/vllm-venv (scripts/bootstrap --local, stage 45): skipped with that reason where it is missing.
"""

from __future__ import annotations

import os

import pytest
from ansible_collections.b300.pd.tests.unit.pd_testlib import run_vllm_plugin_child

CHILD = r"""
import json, os, sys
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
                  "metadata_bytes": len(agent.get_agent_metadata())}))
"""


@pytest.fixture(scope="module")
def child() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PD_NIXL_PROGRESS_DELAY_US"}
    env["UCX_TLS"] = "tcp,self,sm"
    return run_vllm_plugin_child("pd_nixl_progress_delay", CHILD, env)


def test_unset_or_zero_leaves_nixl_alone(child):
    assert child["unchanged"]["unset"] is True
    assert child["unchanged"]["zero"] is True


def test_delay_reaches_the_real_nixl_agent_once_and_the_agent_works(child):
    assert child["unchanged"]["set"] is False
    # Two register() calls, one agent: a double wrap would count the agent twice.
    assert child["applied"] == {"agents": 1, "delay_us": 1000}
    assert child["metadata_bytes"] > 0
