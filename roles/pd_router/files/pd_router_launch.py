#!/usr/bin/env python3
"""Start vllm-router with its own parser, the workers' API key read from a systemd credential.

    <router venv>/bin/python pd-router-launch <vllm-router arguments>

vllm-router takes the key it sends to the vLLM workers only as ``--api-key KEY``, which puts it in
``/proc/<pid>/cmdline`` for every local user to read. The unit instead loads the key with
``LoadCredential=worker-api-key:<file>`` (a root-only file, exposed to this service alone under
``$CREDENTIALS_DIRECTORY``); this launcher parses the arguments with vllm-router's own parser, sets the key on
the parsed arguments (and, for the vLLM P/D path, which reads the key from ``OPENAI_API_KEY`` instead, in the
process environment) and calls vllm-router's own launch function. Without the credential it is plain
``vllm-router <arguments>``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CREDENTIAL = "worker-api-key"


def main(argv: list[str]) -> int:
    from vllm_router.launch_router import launch_router, parse_router_args

    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        print("pd-router-launch: --api-key on the command line would be readable in /proc/<pid>/cmdline; "
              f"give the key as the systemd credential '{CREDENTIAL}' (pd_router_api_key)", file=sys.stderr)
        return 2
    args = parse_router_args(argv)
    cred_dir = os.environ.get("CREDENTIALS_DIRECTORY")
    if cred_dir and (Path(cred_dir) / CREDENTIAL).is_file():
        key = (Path(cred_dir) / CREDENTIAL).read_text().strip()
        args.api_key = key or None
        # The regular router sends args.api_key; the vLLM P/D path (vllm_pd_router.rs, 0.1.17) sends
        # `Authorization: Bearer $OPENAI_API_KEY` from its own environment to the prefill and the decode instead.
        # The process environment is readable by its own user and root only (not /proc/<pid>/cmdline).
        if key:
            os.environ["OPENAI_API_KEY"] = key
    launch_router(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
