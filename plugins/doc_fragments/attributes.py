# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The attributes every b300.pd module documents (in community.general's manner): what check and diff mode mean,
and the support of a module that only reads (INFO_MODULE)."""


class ModuleDocFragment:
    DOCUMENTATION = r"""
options: {}
attributes:
  check_mode:
    description: Can run in C(check_mode) and return changed status prediction without modifying the target.
  diff_mode:
    description: Will return details on what has changed (or would change in C(check_mode)), in diff mode.
"""

    # A module that reads and reports, never changes the host: check mode does the same, and there is no diff.
    INFO_MODULE = r"""
options: {}
attributes:
  check_mode:
    support: full
    details:
      - This action does not modify state.
  diff_mode:
    support: N/A
    details:
      - This action does not modify state.
"""
