# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one error of the collection's filters.

The filter implementations (plugins/plugin_utils/pd_*.py, vllm_install.py) are plain Python and raise
PdFilterError (a ValueError); plugins/filter/pd.py turns any ValueError into Ansible's AnsibleFilterError, so the
message reaches the play as written and unit tests need no Ansible to catch it.
"""

from __future__ import annotations


class PdFilterError(ValueError):
    """Bad input to a filter; the message names the field and the fix."""


def fail(msg):
    raise PdFilterError(msg)
