#!/usr/bin/env python3
"""Give ansible-test the pip bootstrap script it cannot download here.

ansible-test installs pip into each venv it makes by running a get-pip script that it downloads from
ci-files.testing.ansible.com and caches as ~/.ansible/test/cache/get_pip_<version>.py. This site reaches PyPI only.
get-pip.py is pip's own wheel run as `python pip-<v>.whl/pip install ...` (pip runs from its wheel); this writes a
script that does the same with the wheel of the pip version ansible-test pins, downloaded from PyPI with pip's hash
checking against the sha256 pinned here. ansible-test passes get-pip's own flags --no-setuptools/--no-wheel ("do not add
setuptools/wheel"), which pip never adds anyway: they are dropped.

    .venv/bin/python scripts/ansible_test_pip_bootstrap.py      (scripts/test sanity runs it)
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from ansible_test._internal.python_requirements import get_venv_packages

CACHE = Path.home() / ".ansible" / "test" / "cache"
# The pip ansible-test 2.21 pins for its venvs, and its wheel's sha256 (PyPI: pip-25.2-py3-none-any.whl).
PIP_VERSION = "25.2"
PIP_WHEEL_SHA256 = "6d67a2b4e7f14d8b31b8b52648866fa717f45a1eb70e83002f4331d07e953717"

SCRIPT = '''"""get-pip for ansible-test, from pip {version}'s wheel on PyPI (scripts/ansible_test_pip_bootstrap.py)."""
import runpy
import sys

WHEEL = {wheel!r}
sys.path.insert(0, WHEEL)  # pip runs from its own wheel, as get-pip.py does
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
sys.argv = ["pip", "install", "--no-cache-dir", *args]
runpy.run_module("pip", run_name="__main__", alter_sys=True)
'''


def main() -> int:
    version = get_venv_packages(SimpleNamespace(version=f"{sys.version_info.major}.{sys.version_info.minor}"))["pip"]
    target = CACHE / f"get_pip_{version.replace('.', '_')}.py"
    wheel = CACHE / f"pip-{version}-py3-none-any.whl"
    if version != PIP_VERSION:
        print(f"ansible_test_pip_bootstrap: ansible-test pins pip {version}, this script pip {PIP_VERSION}: set "
              f"PIP_VERSION and PIP_WHEEL_SHA256 to pip {version}'s wheel", file=sys.stderr)
        return 1
    if not wheel.is_file() or hashlib.sha256(wheel.read_bytes()).hexdigest() != PIP_WHEEL_SHA256:
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            req = Path(tmp) / "pip.txt"
            req.write_text(f"pip=={version} --hash=sha256:{PIP_WHEEL_SHA256}\n")
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--require-hashes", "-r", str(req), "-d", tmp], check=True)
            (Path(tmp) / wheel.name).replace(wheel)
    target.write_text(SCRIPT.format(version=version, wheel=str(wheel)))
    print(f"ansible-test pip bootstrap: {target} (pip {version} from PyPI, sha256 {PIP_WHEEL_SHA256[:12]}...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
