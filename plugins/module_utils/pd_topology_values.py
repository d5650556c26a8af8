# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""How the topology checks read a value and name it in a problem line; shared by the validation
(pd_topology), the port matrix (pd_topology_ports) and the cluster view (pd_cluster_view)."""

from __future__ import annotations

import difflib
import re

MIN_UNPRIVILEGED_PORT = 1024


def is_int(value):
    """An integer, not a bool (YAML's true would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def short(value):
    """repr() for a problem line, cut so a huge value does not drown the message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def suggest(word, choices):
    match = difflib.get_close_matches(str(word), choices, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def as_port(value):
    """A port as the roles read it (`| int` on a digit string)."""
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,5}", value):
        return int(value)
    return value


def check_port(problems, where, field, value):
    """A vLLM listener's port: an integer the unprivileged vLLM user may bind. Returns True when sound."""
    if not is_int(value) or not 1 <= value <= 65535:
        problems.append(f"{where}, field {field}: {short(value)} is not a TCP port; use an integer in 1024..65535")
        return False
    if value < MIN_UNPRIVILEGED_PORT:
        problems.append(
            f"{where}, field {field}: port {value} is privileged and vLLM runs as an unprivileged user; "
            "use a port in 1024..65535"
        )
        return False
    return True
