# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The rules every inventory string obeys before it is written anywhere (issue 32).

One set of rules, called twice: by the validation (`pd_topology`, `playbooks/validate.yml`), which collects
problem lines for every host before any host is changed, and by each writer (modules and filters), which refuses
the value again when the validation was skipped. Each check raises InputError naming the field and the fix; a
caller that collects problems uses `problems_of`.

The checks are about shape and injection, not meaning: a string that reaches a unit file, an nginx or nft config,
an env file or a path on disk must not carry a newline, a quote, a space where words are split, or a `..`.
"""

from __future__ import annotations

import ipaddress
import re

# C0 and C1 control characters, DEL and the Unicode line/paragraph separators: each ends or splits a config line
# somewhere. The one set of them: pd_recipe's unit and env writers use it too.
CONTROL_CHAR_RE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Instance, unit and label names: they become file names (<name>.env, vllm-<name>.service) and systemd unit names.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
# A DNS name (RFC 1123 labels); an address is checked by ipaddress instead.
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?")
# Characters a path keeps in a systemd path list (ReadWritePaths=), an nft or nginx file: no spaces, quotes, `;`.
_PATH_RE = re.compile(r"/[A-Za-z0-9_.@%+=:,/-]*")
# The zone of a link-local IPv6 address (fe80::1%eth0): an interface name.
_ZONE_RE = re.compile(r"[A-Za-z0-9_.-]{1,15}")

_TYPE_NAMES = {str: "a string", int: "an integer", list: "a list", dict: "a mapping", bool: "true or false"}


class InputError(ValueError):
    """A value from the inventory that must not be written; the message names the field and the fix."""


def _short(value):
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_ok(value, kind):
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _type_name(value):
    """The builtin type a value is (Ansible 2.21 hands templated values over as tagged subclasses, whose own names
    like _AnsibleTaggedInt mean nothing to an operator)."""
    for base in type(value).__mro__:
        if base in (bool, int, float, str, list, dict, tuple, type(None)):
            return base.__name__
    return type(value).__name__


def check_type(field, value, kind):
    """value is of kind (str, int, list, dict, bool); a bool is never an int. Returns value."""
    if not _type_ok(value, kind):
        raise InputError(
            f"{field}: {_short(value)} is {_type_name(value)}, expected {_TYPE_NAMES.get(kind, kind.__name__)}; "
            f"set {field} to {_TYPE_NAMES.get(kind, kind.__name__)}")
    return value


def check_text(field, value):
    """A string with no control character (a newline would split the config line it is written to)."""
    check_type(field, value, str)
    match = CONTROL_CHAR_RE.search(value)
    if match:
        raise InputError(
            f"{field}: {_short(value)} contains the control character U+{ord(match.group()):04X} at "
            f"{match.start()}; it would split the line it is written to: remove it")
    return value


def check_name(field, value):
    """An instance/unit/label name: letters, digits, `_.-`, first a letter or digit, at most 63, never `..`."""
    check_text(field, value)
    if not NAME_RE.fullmatch(value) or ".." in value:
        raise InputError(
            f"{field}: {_short(value)} is not a name; use 1-63 letters, digits, '_', '.', '-', starting with a "
            "letter or digit and without '..' (it becomes a file and unit name)")
    return value


def check_abs_path(field, value):
    """An absolute path with no `..` component and no character that splits a path list (space, quote, `;`)."""
    check_text(field, value)
    if not _PATH_RE.fullmatch(value) or "/../" in value + "/" or value.endswith("/.."):
        raise InputError(
            f"{field}: {_short(value)} is not a plain absolute path; use '/' followed by letters, digits and "
            "'_.@%+=:,/-' only (no spaces, quotes or '..': it is written into a path list)")
    return value


def check_address(field, value):
    """An IPv4/IPv6 address or network (CIDR). Returns the normalized text."""
    text = check_text(field, value)
    try:
        if "%" in text:  # an IPv6 zone: Python keeps any text after '%' ("fe80::1%x ; y"); no firewall set takes one
            raise ValueError(text)
        return str(ipaddress.ip_network(text, strict=False)) if "/" in text else str(ipaddress.ip_address(text))
    except ValueError:
        raise InputError(
            f"{field}: {_short(value)} is not an IP address or network; use e.g. 10.0.0.5, 10.0.0.0/24 or fd00::5"
        ) from None


def check_host(field, value):
    """Where a host is reached: an IP address or a DNS name, no port, no spaces (it becomes an upstream line)."""
    check_text(field, value)
    try:
        ipaddress.ip_address(value)
        # Python keeps any text after an IPv6 zone's '%' ("fe80::1%eth0 ; server x"): only an interface name passes.
        if "%" not in value or _ZONE_RE.fullmatch(value.split("%", 1)[1]):
            return value
    except ValueError:
        pass
    if not _HOSTNAME_RE.fullmatch(value):
        raise InputError(
            f"{field}: {_short(value)} is neither an IP address nor a DNS name; give the address alone (no port, "
            "no spaces): the port comes from its own variable")
    return value


def check_list(field, value, item_check=check_text):
    """A list whose items each pass item_check (named field[i]). Returns the checked items."""
    check_type(field, value, list)
    return [item_check(f"{field}[{i}]", item) for i, item in enumerate(value)]


def problems_of(check, field, value, *args, where=None):
    """[] when check(field, value, *args) passes, else its message as one problem line (prefixed by where)."""
    try:
        check(field, value, *args)
    except InputError as err:
        return [f"{where}, {err}" if where else str(err)]
    return []


def check_strings(field, value):
    """Every string inside value (mapping keys included, nested lists and mappings too) passes check_text; the
    failing one is named field.key or field[i]. For values rendered as a whole (JSON, YAML) into one line."""
    if isinstance(value, str):
        return check_text(field, value)
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                check_text(f"{field} (key {_short(key)})", key)
            check_strings(f"{field}.{key}", item)
    elif isinstance(value, list | tuple):
        for idx, item in enumerate(value):
            check_strings(f"{field}[{idx}]", item)
    return value
