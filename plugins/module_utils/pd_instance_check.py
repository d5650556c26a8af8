# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""vllm_instance's deploy-time check of one instance's argv, before its unit is written.

The parser is the vLLM of the host, run through plugins/module_utils/pd_vllm_argcheck.py, the harness validate.yml
runs on the control node too: deploy refuses what validate refuses (an unknown or abbreviated option, bad JSON, a
value the recipe cannot run with). In the unit's own venv it also checks that the unit's entry point starts there.
Accepted argvs are remembered in the parse cache (plugins/module_utils/pd_parse_cache.py).
"""

from __future__ import annotations

import hashlib
import os
import time

from ansible_collections.b300.pd.plugins.module_utils import pd_vllm_argcheck
from ansible_collections.b300.pd.plugins.module_utils.pd_parse_cache import cache_key, read_cache, write_cache
from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import (
    CLI_LAUNCHER_MODULE,
    CONSOLE_SCRIPT_DISTRIBUTION,
    SERVE_SUBCOMMAND,
)


def entry_point_requirement(command):
    """What the entry point of `command` (pd_recipe.serve_command) needs in its venv, for the harness to check."""
    if len(command) >= 3 and command[1] == "-m":
        return {"module": command[2]}
    if os.path.basename(command[0]) == CONSOLE_SCRIPT_DISTRIBUTION:
        return {"console_script": CONSOLE_SCRIPT_DISTRIBUTION}
    return {}


def validate_with_vllm(module, python, item, timeout=300, *, command=None, others=()):
    """Returns (validated, {"version", "nixl"}, the items of `others` the parser accepted). Fails the module when
    vLLM's parser or the harness's checks refuse the argv of `item` ({instance, pool, argv}).

    With `command` (the unit's own venv), also fails when that entry point cannot start there. `others` (more items)
    are parsed by the same process, which imports vLLM once for all: their problems are not this item's (their own
    check reports them), only whether each was accepted.
    """
    name, argv = item["instance"], item["argv"]
    if not os.path.exists(python):
        module.warn(
            f"instance {name}: {python} does not exist (vLLM not installed yet?); flags were NOT checked "
            "with vLLM's argument parser"
        )
        return False, {}, []
    entry = entry_point_requirement(command) if command else {}
    if entry.get("console_script") and not os.path.exists(command[0]):
        module.fail_json(
            msg=f"instance {name}: the unit would run {command[0]}, which does not exist. Set pd_vllm_package "
            "(module option vllm_package) to the vLLM distribution role vllm_install installed there; "
            "nothing was written.",
            argv=argv,
        )
    report, rc, output = pd_vllm_argcheck.run_check(module, python, [item, *others], subcommand=SERVE_SUBCOMMAND,
                                                    timeout=timeout, entry=entry)
    stage = "run" if report is None else report.get("stage")
    if stage == "import":
        module.fail_json(
            msg=f"instance {name}: {python} cannot import vLLM's argument parser ({report.get('error')}). "
            "Fix the vLLM venv (role vllm_install); nothing was written.",
            argv=argv,
        )
    if stage == "entrypoint":
        module.fail_json(
            msg=f"instance {name}: the unit's entry point `{' '.join(command)}` cannot start in {python}: "
            f"{report.get('error')}. Set pd_vllm_package (module option vllm_package) to the vLLM distribution "
            f"role vllm_install installed there, or rerun vllm_install (it installs {CLI_LAUNCHER_MODULE}); "
            "nothing was written.",
            argv=argv,
        )
    if report is None or not report.get("ok"):
        if report is not None:  # a request the harness could not read
            error = f"{stage}: {report.get('error')}"
        elif rc == 124:
            error = f"timed out after {timeout} s (raise validate_timeout)"
        else:
            error = output
        module.fail_json(
            msg=f"instance {name}: could not run vLLM's argument parser with {python} (rc={rc}: {error}). "
            "Fix the vLLM venv (role vllm_install); nothing was written.",
            argv=argv,
        )
    results = report.get("results") or [{}]
    problems = list(results[0].get("problems") or [])  # results come in request order: this item first
    if problems:
        module.fail_json(
            msg=f"vLLM {report.get('version')} rejects the flags: {'; '.join(problems)}. Fix that flag in "
            "pd_vllm_flags_common / pd_vllm_flags_pool / this instance's extra_flags; nothing was written.",
            argv=argv,
            problems=problems,
            vllm_version=report.get("version"),
        )
    # one result per item asked; an other without its result (a shorter report) is not taken as accepted
    accepted = [other for n, other in enumerate(others, 1) if n < len(results) and not results[n].get("problems")]
    return True, {"version": report.get("version"), "nixl": report.get("nixl")}, accepted


def check_instance_flags(module, item, command, *, python, validate_python, timeout, cache_path, siblings=()):
    """Check the argv of `item` ({instance, pool, argv}) with the vLLM of `validate_python`, or take the verdict the
    parse cache at `cache_path` (None: no cache) holds for it.

    `siblings` (the host's other instances, same items): when the parser has to run, those the cache does not hold
    yet are parsed by the same process and the accepted ones recorded, so that their own check, next in the role's
    loop, takes the cache instead of importing vLLM again (seconds to minutes per import on a loaded host).

    Returns (what the module reports: flags_validated, flags_validation_cached, entry_point_checked and vllm_version
    when known; the {"version", "nixl"} the instance record names, empty unless `validate_python` is the unit's own
    interpreter `python`, as a review render parses with another vLLM).
    """
    # The entry point can only be checked in the venv the unit runs (a review render parses b300's flags
    # with the local CPU build, whose entry point differs by design).
    own_venv = os.path.realpath(validate_python) == os.path.realpath(python)
    checked_command = command if own_venv else None
    # The verdict depends on the harness's checks (the pool's kv role among them), not only on the words parsed.
    harness = hashlib.sha256(pd_vllm_argcheck.harness_source().encode()).hexdigest()[:16]

    def payload(one):
        return {"harness": harness, "pool": one.get("pool"),
                "words": [*(checked_command or [SERVE_SUBCOMMAND]), *one["argv"]]}

    use_cache = bool(cache_path) and os.path.exists(validate_python)
    key = cache_key(validate_python, payload(item)) if use_cache else None
    cache = read_cache(cache_path) if use_cache else {}
    reported = {"flags_validation_cached": False}

    def cached(k):  # an entry written before records existed has no NIXL version: parse again once to learn it
        return k in cache and "nixl" in cache[k]

    if key and cached(key):
        validated, versions = True, cache[key]
        reported["flags_validation_cached"] = True
    else:
        # Siblings ride along only where their verdict can be kept (a cache, and not check mode).
        others = [s for s in siblings if s["instance"] != item["instance"]
                  and not cached(cache_key(validate_python, payload(s)))] if key and not module.check_mode else []
        validated, versions, accepted = validate_with_vllm(module, validate_python, item, timeout,
                                                           command=checked_command, others=others)
        if validated and key and not module.check_mode:
            now = int(time.time())
            for one in [item, *accepted]:  # keys again: a first import may add a __pycache__
                cache[cache_key(validate_python, payload(one))] = {
                    "version": versions.get("version"), "nixl": versions.get("nixl"), "at": now,
                    "instance": one["instance"]}
            write_cache(cache_path, cache)
            reported["flags_validated_with"] = sorted(one["instance"] for one in accepted)
    reported["flags_validated"] = validated
    reported["entry_point_checked"] = validated and own_venv
    if versions.get("version"):
        reported["vllm_version"] = versions["version"]
    record_versions = {"version": versions.get("version"), "nixl": versions.get("nixl")} if own_venv else {}
    return reported, record_versions
