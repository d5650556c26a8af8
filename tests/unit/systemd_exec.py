"""Read a rendered unit's ExecStart= back into the words systemd runs (the inverse of pd_unit's quoting).

Tests only: production writes units and never parses them (the change path reads the instance record instead).
"""

from __future__ import annotations

import re


def systemd_split(command_line):
    """Inverse of the ExecStart rendering: continuation lines, quotes, C escapes, %% and $$.

    Enough of systemd's extract_first_word() to read back what render_unit() writes.
    """
    text = command_line.replace("\\\n", " ")
    words, cur, i, quote, have = [], [], 0, None, False
    escapes = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"', " ": " "}
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            cur.append(escapes.get(text[i + 1], text[i + 1]))
            have = True
            i += 2
            continue
        if ch in "%$" and i + 1 < len(text) and text[i + 1] == ch:
            cur.append(ch)
            have = True
            i += 2
            continue
        if quote:
            if ch == quote:
                quote = None
            else:
                cur.append(ch)
        elif ch in "'\"":
            quote, have = ch, True
        elif ch.isspace():
            if have:
                words.append("".join(cur))
                cur, have = [], False
        else:
            cur.append(ch)
            have = True
        i += 1
    if quote:
        raise ValueError("unterminated quote in command line")
    if have:
        words.append("".join(cur))
    return words


def exec_start_argv(unit_text):
    """The ExecStart command of a rendered unit, split back into words."""
    m = re.search(r"^ExecStart=((?:.*\\\n)*.*)$", unit_text, re.M)
    if not m:
        raise ValueError("no ExecStart= in unit")
    return systemd_split(m.group(1))
