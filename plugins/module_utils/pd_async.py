# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""One status check of an ansible-core async job, telling a running job from one whose processes are gone.

ansible-core's async_wrapper forks the module and waits 2.5 s for the child to report in. On a loaded host the
child can be later: the parent then returns "started" and closes the pipe, the child dies writing to it
(EPIPE) before running the module, and the job's results file keeps {"started": true, "finished": false}
forever. async_status (and `poll: N`) read only that file, so the play waits for the whole async limit.
job_status() also looks for the job's async_wrapper processes: a job that is not finished and has none is
reported as vanished, so the caller can fail at once.

The job id is "<jid>.<pid of the first wrapper process>"; every process of the job (the daemon, its
supervisor, the module runner) is a fork of that wrapper and keeps its argv, which holds "<jid>" on its own
next to the async_wrapper script. The module itself is a child of the module runner, so while it runs the
runner is there too.
"""

from __future__ import annotations

import json
import os

RUNNING = "running"
FINISHED = "finished"
VANISHED = "vanished"


def job_prefix(job_id: str) -> str:
    """The jid argument async_wrapper was started with: the job id without its ".<pid>" suffix."""
    return job_id.rsplit(".", 1)[0] if "." in job_id else job_id


def read_results(path: str) -> tuple[dict | None, str | None]:
    """(data, problem): data None when the file is missing or not a JSON object (problem says which)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None, "no results file"
    except OSError as e:
        return None, f"results file unreadable ({e.strerror})"
    try:
        data = json.loads(text)
    except ValueError:
        return None, f"results file is not JSON ({text[:200]!r})"
    if not isinstance(data, dict):
        return None, f"results file holds no JSON object ({text[:200]!r})"
    return data, None


def is_finished(data: dict | None) -> bool:
    """async_status' rule: the module's own result has no "started" key; the wrapper's marker has finished."""
    return data is not None and ("started" not in data or bool(data.get("finished")))


def job_processes(job_id: str, proc_root: str = "/proc") -> list[int]:
    """PIDs of the processes started by async_wrapper for this job (argv holds the jid and the wrapper script)."""
    prefix = job_prefix(job_id).encode()
    pids = []
    for entry in os.listdir(proc_root):
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc_root, entry, "cmdline"), "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue  # exited while we looked, or not ours to read
        if prefix in argv and any(b"async_wrapper" in os.path.basename(a) for a in argv):
            pids.append(int(entry))
    return sorted(pids)


def job_status(job_id: str, results_file: str, proc_root: str = "/proc") -> dict:
    """{state: running|finished|vanished, data, problem, pids} for one look at the job."""
    data, problem = read_results(results_file)
    if is_finished(data):
        return {"state": FINISHED, "data": data, "problem": None, "pids": []}
    pids = job_processes(job_id, proc_root)
    if pids:
        return {"state": RUNNING, "data": data, "problem": problem, "pids": pids}
    # The job may have written its result and exited between the first read and the process scan: the
    # wrapper renames the result into place before its processes exit, so a second read settles it.
    data, problem = read_results(results_file)
    if is_finished(data):
        return {"state": FINISHED, "data": data, "problem": None, "pids": []}
    return {"state": VANISHED, "data": data, "problem": problem, "pids": []}


def vanished_message(host: str, job_id: str, description: str, results_file: str, status: dict) -> str:
    what = status["problem"] or "its results file still says started, not finished"
    return (
        f"{host}: async job {job_id} ({description}) vanished: {what} ({results_file}) and no async_wrapper "
        f"process of the job is left, so it will never finish. Usually ansible-core's async_wrapper lost its "
        f"2.5 s start-up handshake on a loaded host (journal: 'ansible-async_wrapper' ... 'Broken pipe'), or "
        f"the job was killed. Nothing of it runs any more: re-run the play (the task is idempotent), on a "
        f"less loaded host if it recurs"
    )


def timeout_message(host: str, job_id: str, description: str, limit_var: str, data: dict) -> str:
    hint = f"; if the work really needs longer, raise {limit_var}" if limit_var else ""
    return (
        f"{host}: async job {job_id} ({description}) was killed by async_wrapper at its time limit "
        f"({data.get('msg')}, child pid {data.get('child_pid')}){hint}"
    )


def is_timeout(data: dict | None) -> bool:
    """async_wrapper's own result when it kills the job at the limit (it writes no 'started' key)."""
    return bool(data) and data.get("failed") is True and data.get("msg") == "Timeout exceeded" and "child_pid" in data
