# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which revisions model_weights keeps for rollback: the keep most recently served (by the history of served
revisions, then by age for revisions it never served), never the served one, never one a vLLM instance record names.

Stdlib only: runs on the managed hosts."""

from dataclasses import dataclass

from ansible_collections.b300.pd.plugins.module_utils.model_in_use import revisions_in_use


@dataclass
class Retention:
    """The outcome of planning what to prune under a RevisionStore.

    to_prune: revisions to delete. present: revisions on disk (sorted). in_use: {revision: [record paths]} of every
    revision an instance record names. kept_in_use: revisions beyond keep kept because a record names them.
    record_problems: records that could not be read ("<path>: <why>"); when any, nothing is pruned.
    """

    to_prune: list
    present: list
    in_use: dict
    kept_in_use: list
    record_problems: list


def plan_retention(store, keep, in_use_records):
    """Revisions to delete: beyond the keep most recently served, not the served one and not named by any instance
    record (the records matching the glob patterns in_use_records)."""
    revision = store.revision
    in_use, record_problems = revisions_in_use(in_use_records, store.revs_dir)
    present = store.present_revisions()
    history = served_history(store)
    known = [revision] + [r for r in history[1:] if r in present]  # the new one counts before it exists
    unknown = sorted((r for r in present if r not in history), key=store.revision_mtime, reverse=True)
    beyond = [r for r in (known + unknown)[keep:] if r != revision]
    if record_problems:
        # Any revision may be what the unreadable record's instance runs: keep them all until it is fixed.
        return Retention([], sorted(present), in_use, [], record_problems)
    kept_in_use = [r for r in beyond if r in in_use]
    return Retention([r for r in beyond if r not in in_use], sorted(present), in_use, kept_in_use, record_problems)


def served_history(store):
    """The history of served revisions with this run's revision first (it is being served now)."""
    return [store.revision] + [r for r in store.history() if r != store.revision]
