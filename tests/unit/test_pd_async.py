"""pd_async_job / plugins/module_utils/pd_async: an async job whose processes are gone fails at once, not at the limit.

Most tests use a fake /proc (a directory of <pid>/cmdline files) and hand-written results files; one spawns a
real short-lived process; one drives the module through ansible-playbook on localhost. The role tests check
every async task of model_weights, vllm_install and pd_verify waits through pd_async_job, and that the limits
follow the work.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import yaml
from ansible_collections.b300.pd.plugins.module_utils import pd_async
from ansible_collections.b300.pd.tests.unit.pd_testlib import ROOT, load_library, run_module

mod = load_library("pd_async_job")

JID = "j123456789012.4242"
WRAPPER = "/root/.ansible/tmp/ansible-tmp-1.2-3/AnsiballZ_async_wrapper.py"
MODULE = "/root/.ansible/tmp/ansible-tmp-1.2-3/AnsiballZ_model_weights.py"


def fake_proc(root: Path, procs: dict[int, list[str]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for pid, argv in procs.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (root / "self").mkdir(exist_ok=True)  # non-numeric entries are skipped
    return root


def wrapper_argv(jid_prefix: str = "j123456789012") -> list[str]:
    # what ansible-core runs: interpreter, async_wrapper, jid, limit, preserve_tmp, module, args file
    return ["/usr/bin/python3", WRAPPER, jid_prefix, "601", "false", MODULE, MODULE + ".args"]


def write_results(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


STARTED = {"started": True, "finished": False, "ansible_job_id": JID}


# ------------------------------------------------------------------ module_utils: one look at the job


def test_started_job_with_its_processes_is_running(tmp_path):
    proc = fake_proc(tmp_path / "proc", {100: wrapper_argv(), 101: wrapper_argv(), 7: ["/sbin/init"]})
    st = pd_async.job_status(JID, str(write_results(tmp_path / JID, STARTED)), str(proc))
    assert st["state"] == pd_async.RUNNING and st["pids"] == [100, 101]


def test_started_job_without_processes_has_vanished(tmp_path):
    # The journal of the measured hang: the module runner died on EPIPE, "Done in kid B", file says started.
    proc = fake_proc(tmp_path / "proc", {7: ["/sbin/init"], 8: ["sshd: root@pts/0"]})
    st = pd_async.job_status(JID, str(write_results(tmp_path / JID, STARTED)), str(proc))
    assert st["state"] == pd_async.VANISHED and st["pids"] == []


def test_only_this_jobs_wrapper_counts(tmp_path):
    proc = fake_proc(tmp_path / "proc", {
        200: wrapper_argv("j1234567890123"),  # another job whose jid starts with ours
        201: wrapper_argv("j999"),
        202: ["/usr/bin/python3", "-c", "pass", "j123456789012"],  # our jid, but not async_wrapper
    })
    assert pd_async.job_processes(JID, str(proc)) == []


def test_finished_result_is_finished_whatever_the_processes(tmp_path):
    # async_wrapper's supervisor lingers up to 5 s after the module wrote its result
    proc = fake_proc(tmp_path / "proc", {100: wrapper_argv()})
    res = write_results(tmp_path / JID, {"changed": True, "rc": 0, "ansible_job_id": JID})
    assert pd_async.job_status(JID, str(res), str(proc))["state"] == pd_async.FINISHED


def test_result_written_during_the_process_scan_is_not_taken_for_vanished(tmp_path, monkeypatch):
    res = write_results(tmp_path / JID, STARTED)

    def scan_while_the_job_finishes(job_id, proc_root):
        write_results(res, {"changed": False, "rc": 0})  # the job renames its result into place and exits
        return []

    monkeypatch.setattr(pd_async, "job_processes", scan_while_the_job_finishes)
    st = pd_async.job_status(JID, str(res), "/nonexistent")
    assert st["state"] == pd_async.FINISHED and st["data"]["rc"] == 0


def test_missing_results_file(tmp_path):
    proc = fake_proc(tmp_path / "proc", {100: wrapper_argv()})
    assert pd_async.job_status(JID, str(tmp_path / JID), str(proc))["state"] == pd_async.RUNNING  # still starting
    st = pd_async.job_status(JID, str(tmp_path / JID), str(fake_proc(tmp_path / "proc2", {})))
    assert st["state"] == pd_async.VANISHED and st["problem"] == "no results file"


def test_a_real_process_is_found_then_gone(tmp_path):
    # A short-lived process with async_wrapper's argv shape; it lives until its stdin closes (no sleeps).
    res = write_results(tmp_path / "j424242424242.1", dict(STARTED, ansible_job_id="j424242424242.1"))
    p = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()",
                          WRAPPER, "j424242424242", "60"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        # Popen returns while exec may still be setting up the new argv: wait until the child runs its code.
        assert p.stdout.readline() == "up\n"
        st = pd_async.job_status("j424242424242.1", str(res))
        assert st["state"] == pd_async.RUNNING and p.pid in st["pids"]
    finally:
        p.stdin.close()
        p.wait(timeout=30)
        p.stdout.close()
    assert pd_async.job_status("j424242424242.1", str(res))["state"] == pd_async.VANISHED


def test_real_async_wrapper_job_whose_processes_died_has_vanished(tmp_path):
    # ansible-core's own async_wrapper starts a job; its module runner is then killed before it writes a result
    # (what EPIPE does to it when the start-up handshake is lost): the results file says started forever.
    import ansible.modules.async_wrapper as wrapper

    job = tmp_path / "job.sh"
    job.write_text("#!/bin/sh\nexec sleep 60\n")
    job.chmod(0o755)
    env = dict(os.environ, ANSIBLE_ASYNC_DIR=str(tmp_path / "async"))
    # argv: jid, limit, preserve_tmp, module path (its directory is removed unless preserved), command to run.
    # -I: the script's own directory (ansible/modules, with a copy.py and a tempfile.py) must not shadow the stdlib
    p = subprocess.run([sys.executable, "-I", wrapper.__file__, "j515151515151", "120", "true", str(job), str(job)],
                       capture_output=True, text=True, env=env, timeout=60, check=True)
    started = json.loads(p.stdout)
    jid, results = started["ansible_job_id"], started["results_file"]
    assert jid.startswith("j515151515151.") and started["started"] is True
    st = pd_async.job_status(jid, results)
    # The daemonized supervisor and the runner carry the jid. (Had this loaded host lost the 2.5 s handshake,
    # the runner would be dead already and the supervisor gone or about to go: the end state is the same.)
    assert st["state"] in (pd_async.RUNNING, pd_async.VANISHED), st
    pidfds = []
    for pid in st["pids"]:
        try:
            pidfds.append(os.pidfd_open(pid))
            if os.getpgid(pid) == pid:
                os.killpg(pid, 9)  # the runner leads a group with the job's own process (sleep) in it
            else:
                os.kill(pid, 9)
        except ProcessLookupError:
            pass  # exited on its own since the scan
    for fd in pidfds:  # wait for them to exit without sleeping: a pidfd turns readable at exit
        assert select.select([fd], [], [], 30)[0], "a killed job process did not exit"
        os.close(fd)
    st = pd_async.job_status(jid, results)
    assert st["state"] == pd_async.VANISHED, st
    assert json.loads(Path(results).read_text())["finished"] is False  # what async_status keeps reading


# ------------------------------------------------------------------ the module


def args(tmp_path, **kw):
    return dict({"jid": JID, "results_file": str(tmp_path / JID), "description": "model_weights fetch of rev abc",
                 "host": "b300-01", "limit_var": "model_weights_async_timeout"}, **kw)


def test_a_vanished_async_job_fails_with_a_clear_message(tmp_path, monkeypatch):
    write_results(tmp_path / JID, STARTED)
    monkeypatch.setattr(mod, "PROC_ROOT", str(fake_proc(tmp_path / "proc", {7: ["/sbin/init"]})))
    res, failed = run_module(mod.main, args(tmp_path), monkeypatch=monkeypatch)
    assert failed and res["finished"] is True and res["state"] == "vanished"
    msg = res["msg"]
    assert msg.startswith(f"b300-01: async job {JID} (model_weights fetch of rev abc) vanished: ")
    assert "still says started, not finished" in msg and str(tmp_path / JID) in msg
    assert "re-run the play" in msg  # the fix
    assert (tmp_path / JID).exists()  # kept for whoever looks into it


def test_running_job_is_not_finished(tmp_path, monkeypatch):
    write_results(tmp_path / JID, STARTED)
    monkeypatch.setattr(mod, "PROC_ROOT", str(fake_proc(tmp_path / "proc", {300: wrapper_argv()})))
    res, failed = run_module(mod.main, args(tmp_path), monkeypatch=monkeypatch)
    assert not failed and res["finished"] is False and res["pids"] == [300] and res["changed"] is False


def test_finished_job_hands_back_its_own_result_and_drops_the_file(tmp_path, monkeypatch, capsys):
    job = {"changed": True, "revision": "abc", "summary": {"fetched": 4}, "invocation": {"module_args": {}}}
    write_results(tmp_path / JID, job)
    monkeypatch.setattr(mod, "PROC_ROOT", str(fake_proc(tmp_path / "proc", {})))
    with pytest.raises(SystemExit) as e:
        run_module(mod.main, args(tmp_path), monkeypatch=monkeypatch)
    assert e.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["changed"] is True and out["summary"] == {"fetched": 4} and out["finished"] is True
    assert out["ansible_job_id"] == JID and not (tmp_path / JID).exists()


def test_job_killed_at_the_limit_names_the_variable(tmp_path, monkeypatch):
    write_results(tmp_path / JID, {"msg": "Timeout exceeded", "failed": True, "child_pid": 4244})
    monkeypatch.setattr(mod, "PROC_ROOT", str(fake_proc(tmp_path / "proc", {})))
    res, failed = run_module(mod.main, args(tmp_path), monkeypatch=monkeypatch)
    assert failed and res["finished"] is True
    assert "b300-01: async job" in res["msg"] and "raise model_weights_async_timeout" in res["msg"]


def test_empty_jid_is_refused(tmp_path, monkeypatch):
    res, failed = run_module(mod.main, args(tmp_path, jid=" "), monkeypatch=monkeypatch)
    assert failed and res["finished"] is True and "jid is empty" in res["msg"]


def test_through_ansible_playbook_a_vanished_job_fails_on_the_first_look(tmp_path):
    # The state the measured hang left: a results file that says started, no process. The old tasks polled it
    # with async_status (poll: N), which reports finished=false until the async limit (86400 s).
    results = write_results(tmp_path / "j777777777777.1", dict(STARTED, ansible_job_id="j777777777777.1"))
    pb = tmp_path / "pb.yml"
    pb.write_text(yaml.safe_dump([{
        "name": "Wait", "hosts": "all", "gather_facts": False, "tasks": [
            {"name": "Old path: async_status on it", "ansible.builtin.async_status": {"jid": "j777777777777.1"},
             "register": "old"},
            {"name": "Old path said", "ansible.builtin.assert": {"that": ["old is not finished"]}},
            {"name": "Wait for the job", "b300.pd.pd_async_job": {
                "jid": "j777777777777.1", "results_file": str(results), "description": "test job",
                "host": "{{ inventory_hostname }}"},
             "register": "r", "until": "r is finished", "retries": 50, "delay": 10}]}]))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_CACHE_PLUGIN="memory",
               ANSIBLE_ASYNC_DIR=str(tmp_path))
    p = subprocess.run([str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                        "-e", "ansible_python_interpreter=" + shutil.which("python3"), str(pb)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False)
    out = p.stdout
    assert re.search(r"localhost\s*:\s*ok=2\s+changed=0\s+unreachable=0\s+failed=1", out), out[-3000:] + p.stderr
    assert "FAILED - RETRYING" not in out  # failed on the first look, no 10 s wait
    assert "localhost: async job j777777777777.1 (test job) vanished" in re.sub(r"\s+", " ", out)


# ------------------------------------------------------------------ the roles


ASYNC_TASK_FILES = ["roles/model_weights/tasks/fetch.yml", "roles/vllm_install/tasks/install.yml",
                    "roles/pd_verify/tasks/run.yml"]


@pytest.mark.parametrize("path", ASYNC_TASK_FILES)
def test_every_async_task_is_waited_for_by_pd_async_job(path):
    tasks = yaml.safe_load((ROOT / path).read_text())
    started = [i for i, t in enumerate(tasks) if "async" in t]
    assert started, f"{path}: no async task"
    for i in started:
        t, wait = tasks[i], tasks[i + 1]
        assert t["poll"] == 0, f"{path}: {t['name']} polls with async_status (poll: {t['poll']})"
        job = t["register"]
        waiter = wait.get("b300.pd.pd_async_job", {})
        assert waiter.get("jid") == "{{ " + job + ".ansible_job_id }}", (path, wait.get("name"))
        assert waiter["results_file"] == "{{ " + job + ".results_file }}"
        assert waiter["host"] == "{{ inventory_hostname }}"
        assert wait["until"] == f"{wait['register']} is finished"
        assert wait["when"] == f"{job} is not skipped"
        assert wait["delay"] in (10, "{{ model_weights_async_poll | int }}")  # a vanished job fails within ~15 s


def render(expr: str, variables: dict):
    # plain text out, as Ansible's own templating (no HTML here to escape)
    return jinja2.Environment(autoescape=False).from_string(expr).render(**variables)  # noqa: S701


def model_weights_limit(variables: dict) -> int:
    d = yaml.safe_load((ROOT / "roles/model_weights/defaults/main.yml").read_text())
    scope = dict(d, **variables)
    scope["model_weights_size_bytes"] = render(d["model_weights_size_bytes"], scope)
    return int(render(d["model_weights_async_timeout"], scope))


def test_model_weights_limit_follows_the_revision_size(local_inv, b300):
    assert model_weights_limit(local_inv["group_vars"]) == 601  # 16 MiB: the floor, not a day
    assert "pd_model_size_bytes" not in b300["group_vars"]
    assert model_weights_limit(b300["group_vars"]) == 15502  # 500 GB at 32 MiB/s + 600 s: ~4.3 h
    assert model_weights_limit({"pd_model_size_bytes": 0}) == 600


def test_pip_and_verify_limits_are_inventory_values(local_inv, b300):
    assert local_inv["group_vars"]["vllm_install_pip_timeout"] == 1800
    assert local_inv["group_vars"]["pd_verify_timeout_s"] == 1800
    assert b300["group_vars"]["pd_verify_timeout_s"] == 7200
    defaults = yaml.safe_load((ROOT / "roles/vllm_install/defaults/main.yml").read_text())
    assert defaults["vllm_install_pip_timeout"] == 3600
