# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a model_weights run reports: the per-file states and their counts, the diff of the served link and the
revisions on disk, and the warnings an operator must act on.

Stdlib only: runs on the managed hosts."""


def files_report(manifest, states):
    """One {path, size, state} per manifest entry, in manifest order."""
    return [{"path": f["path"], "size": f["size"], "state": states[f["path"]]} for f in manifest["files"]]


def state_counts(states):
    """{state: number of files in it}."""
    summary = {}
    for s in states.values():
        summary[s] = summary.get(s, 0) + 1
    return summary


def revisions_diff(served, revision, revisions_before, retention):
    """The diff (--diff) of a run that switches the link or prunes or keeps a revision for an instance; None else.

    served: the ServedLink as planned; revisions_before: the revisions on disk before the run; retention: the
    Retention the run acted on."""
    if served.ok and not retention.to_prune and not retention.kept_in_use:
        return None
    revisions_after = sorted(r for r in set(revisions_before) | {revision} if r not in retention.to_prune)
    after = {"link": served.link, "target": served.want_target, "revisions": revisions_after}
    if retention.kept_in_use:
        after["kept_in_use"] = {r: retention.in_use[r] for r in retention.kept_in_use}
    return {
        "before": {"link": served.link, "target": served.current_target or "(absent)",
                   "revisions": revisions_before},
        "after": after,
    }


def unreadable_records_warning(root, record_problems):
    return (
        f"pruned no revision under {root}/revisions: {len(record_problems)} vLLM instance record(s) "
        "matching in_use_records could not be read, so any revision may still be in use: "
        + "; ".join(record_problems)
        + "; fix or remove the record (re-running the vllm_serve role rewrites it) and rerun"
    )
