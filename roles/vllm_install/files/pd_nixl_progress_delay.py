"""vLLM general plugin (installed by roles/vllm_install): give NIXL's UCX progress thread a poll timeout.

NIXL's Python API creates its agent with ``pthrDelay = 0``: the UCX progress thread then calls ``poll()``
with a zero timeout in a loop and burns a whole core per vLLM worker, busy or idle. That is NIXL's choice
for GPU servers with cores to spare; on small CPU-only hosts (3 engines on 2 cores) it
starves the engines themselves. This plugin sets ``pthrDelay`` to ``$PD_NIXL_PROGRESS_DELAY_US``
microseconds (NIXL rounds it up to whole milliseconds): the thread then sleeps in ``poll()`` until UCX has
work or the delay passes. vLLM loads it in every process through the ``vllm.general_plugins`` entry point.

The variable comes from the inventory's pd_vllm_env (so a change restarts the instances through vllm_serve);
roles/vllm_install installs this file only where pd_vllm_env sets it. Unset or 0: the plugin does nothing.
"""

import logging
import os
import types

ENV = "PD_NIXL_PROGRESS_DELAY_US"
_log = logging.getLogger("vllm.pd_nixl_progress_delay")
applied = {"agents": 0, "delay_us": None}


def register():
    """Entry point: wrap the NIXL bindings' agent constructor once per process."""
    delay_us = int(os.environ.get(ENV) or 0)
    if delay_us <= 0:
        return
    # vLLM sets this before it imports NIXL (a UCX leak workaround, vllm/distributed/nixl_utils.py);
    # importing NIXL here first would stop it from doing so.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        import nixl._api as api
    except ImportError:
        return  # no NIXL in this venv: nothing to tune
    if getattr(api.nixlBind, "pd_progress_delay_us", None) is not None:
        return  # already wrapped in this process
    real = api.nixlBind

    class _Bindings(types.ModuleType):
        pd_progress_delay_us = delay_us

        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def nixlAgent(name, config):  # noqa: N802 - the bindings' name
            config.pthrDelay = max(int(config.pthrDelay), delay_us)
            applied["agents"] += 1
            applied["delay_us"] = config.pthrDelay
            _log.info("NIXL agent %s: UCX progress thread poll delay %d us", name, config.pthrDelay)
            return real.nixlAgent(name, config)

    api.nixlBind = _Bindings(real.__name__)
