"""Issue 32, authenticated hops: every vLLM instance of the embedded default requires the workers' key.

Run on the live stack after site.yml (the lead runs it; the stack is test_local_stack.py's, left up with
PD_KEEP_STACK=1):

    .venv/bin/pytest -q -p no:cacheprovider tests/integration/test_worker_key.py

- a request to each instance's /v1 without the key, with a wrong key or with a client (front door) key gets 401; with
  the workers' key 200; /health stays open (vLLM guards /v1 only; the firewall limits who reaches the port);
- P/D through the front door still works (the routers send the key: a decode instance served the request);
- the key is in no unit file, env file, record or rollback copy, no /proc/*/cmdline, no journal, no world-readable
  file, on any vLLM or router host; the one file holding it on a vLLM host is /etc/vllm/api-key.env, 0640 root:vllm,
  and it is the key scripts/bootstrap made (.cache/worker/api-key), compared by digest.

The requests to the instances go from the router host (the peer the firewall lets reach vLLM's port), with curl reading
the header from a 0600 file written by printf (a shell builtin) from the root-only credential the router units load:
the key never reaches an argv, here or there.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from ansible_collections.b300.pd.bench.pd_load_config import client_api_key
from test_local_stack import ROOT, complete_through_router, frontdoor_paths, host_cmd, record
from test_local_stack import inventory as _inventory_fixture

inventory = _inventory_fixture  # the session fixture of test_local_stack.py (addresses from the inventory)

# What the router units load as their systemd credential (roles/pd_router/tasks/service.yml).
ROUTER_KEY_FILE = "/etc/vllm-router/worker-api-key"
INSTANCE_KEY_FILE = "/etc/vllm/api-key.env"
# The model ids of a /v1/models answer on stdin, comma-separated (run on the host).
LIST_IDS = 'import json, sys; print(",".join(m["id"] for m in json.load(sys.stdin)["data"]))'


def worker_key() -> str:
    path = Path(os.environ.get("PD_WORKER_KEY_FILE") or ROOT / ".cache/worker/api-key")
    key = path.read_text().strip()
    assert key, f"{path} is empty: scripts/bootstrap (stage 65-worker-key) makes it"
    return key


def _status_lines(out: str) -> dict:
    return dict(line.split(" ", 1) for line in out.strip().splitlines() if " " in line)


def test_every_instance_requires_the_worker_key_on_v1_only(inventory):
    router = inventory["router_host"]
    hdr = "/root/.pd-test-worker-hdr"
    results = {}
    for inst in inventory["instances"]:
        url = inst["url"]
        body = json.dumps({"model": inventory["model"], "prompt": "Q: 1+1= A:", "max_tokens": 2})
        # The header file is made from the root-only credential with printf (a shell builtin): no argv holds the key.
        script = f"""set -u
umask 077
printf 'Authorization: Bearer %s\\n' "$(cat {ROUTER_KEY_FILE})" > {hdr}
code() {{ curl -s -o /dev/null -w '%{{http_code}}' -m 60 "$@"; }}
echo "models_no_key $(code {url}/v1/models)"
echo "models_wrong_key $(code -H 'Authorization: Bearer {'0' * 64}' {url}/v1/models)"
echo "completion_no_key $(code -H 'Content-Type: application/json' -d '{body}' {url}/v1/completions)"
echo "models_key $(code -H @{hdr} {url}/v1/models)"
echo "completion_key $(code -H @{hdr} -H 'Content-Type: application/json' -d '{body}' {url}/v1/completions)"
echo "health_no_key $(code {url}/health)"
echo "metrics_no_key $(code {url}/metrics)"
echo "listed $(curl -s -m 30 -H @{hdr} {url}/v1/models | python3 -c '{LIST_IDS}')"
rm -f {hdr}
"""
        results[inst["name"]] = _status_lines(host_cmd(router, script, timeout=300))
    record("worker-key-auth", results)
    for name, found in results.items():
        assert found["models_no_key"] == "401", (name, found)
        assert found["models_wrong_key"] == "401", (name, found)
        assert found["completion_no_key"] == "401", (name, found)
        assert found["models_key"] == "200", (name, found)
        assert found["completion_key"] == "200", (name, found)
        assert found["health_no_key"] == "200", (name, found)
        assert found["metrics_no_key"] == "200", (name, found)
        assert inventory["model"] in found["listed"].split(","), (name, found)


def test_the_client_key_does_not_open_a_worker(inventory):
    """The front door's client key is not the workers' key: an instance refuses it (a client that reached an
    instance's port with its own key is still out). Sent from the router host; ssh's command carries only the key's
    sha256, the host finds the key in the front door's key map by that digest."""
    router = inventory["router_host"]
    client = client_api_key()
    assert client, "no client key: scripts/bootstrap writes .cache/frontdoor/api-key"
    digest = hashlib.sha256(client.encode()).hexdigest()
    inst = inventory["instances"][0]
    hdr = "/root/.pd-test-client-hdr"
    script = f"""set -eu
umask 077
# the client keys nginx matches (roles/pd_frontdoor: one regex line per key), unescaped, one per line
sed -n 's/^"~^Bearer \\(.*\\)\\$" k[0-9a-f]\\{{8\\}};$/\\1/p' /etc/nginx/pd-frontdoor/api-keys.map \\
    | sed 's/\\\\\\(.\\)/\\1/g' | while IFS= read -r k; do
  if [ "$(printf '%s' "$k" | sha256sum | cut -d' ' -f1)" = "{digest}" ]; then
    printf 'Authorization: Bearer %s\\n' "$k" > {hdr}
    echo "client_key $(curl -s -o /dev/null -w '%{{http_code}}' -m 30 -H @{hdr} {inst['url']}/v1/models)"
    rm -f {hdr}
  fi
done
"""
    found = _status_lines(host_cmd(router, script))
    record("worker-key-client-key-refused", found)
    assert found.get("client_key") == "401", found


def test_pd_through_the_front_door_works_with_the_key(inventory):
    router = inventory["router_host"]
    before = frontdoor_paths(router).get("pd", 0.0)
    answers = [complete_through_router(inventory, prompt=f"Q: {n}+1= A:") for n in range(3)]
    after = frontdoor_paths(router).get("pd", 0.0)
    record("worker-key-pd", {"pd_before": before, "pd_after": after,
                             "tokens": [a.get("usage", {}).get("completion_tokens") for a in answers]})
    assert all(a.get("choices") for a in answers), answers
    assert after - before >= 3, (before, after)  # served P/D, not by the colocated backup path


def test_worker_key_is_in_no_unit_record_argv_or_journal(inventory):
    """On every vLLM host and the router host: the key's only files are the instances' key file (0640 root:vllm)
    and the routers' credential (0600 root:root); no unit, env file, record, rollback copy, /proc/*/cmdline,
    journal, log file or other world-readable file holds it. grep reads the key from a file (-f), never argv."""
    digest = hashlib.sha256(worker_key().encode()).hexdigest()
    hosts = sorted({i["host"] for i in inventory["instances"]} | {inventory["router_host"]})
    keyfile = "/root/.pd-test-worker-key"
    found_all = {}
    for host in hosts:
        script = f"""set -eu
umask 077
if [ -f {INSTANCE_KEY_FILE} ]; then
  sed -n 's/^VLLM_API_KEY="\\(.*\\)"$/\\1/p' {INSTANCE_KEY_FILE} > {keyfile}
  echo "instance_key_file $(stat -c '%a %U:%G' {INSTANCE_KEY_FILE})"
else
  tr -d '\\n' < {ROUTER_KEY_FILE} > {keyfile}
  echo "instance_key_file none"
fi
test -s {keyfile}
echo "digest $(tr -d '\\n' < {keyfile} | sha256sum | cut -d' ' -f1)"
[ -f {ROUTER_KEY_FILE} ] && echo "router_key_file $(stat -c '%a %U:%G' {ROUTER_KEY_FILE})"
units=0
for f in /etc/systemd/system/vllm-*.service; do  # the instances' and the routers' units
  [ -f "$f" ] && grep -q -F -f {keyfile} "$f" && units=$((units+1))
done
echo "units $units"
echo "systemctl_show $(systemctl show 'vllm-*' 2>/dev/null | grep -c -F -f {keyfile} || true)"
other=0
for f in /etc/vllm/*.env /etc/vllm/*.record.json /etc/vllm/rollback/* /etc/vllm/.flags-validated.json; do
  [ -f "$f" ] && [ "$f" != {INSTANCE_KEY_FILE} ] && grep -q -F -f {keyfile} "$f" && other=$((other+1))
done
echo "env_records_rollback $other"
argv=0
for f in /proc/[0-9]*/cmdline; do tr '\\000' ' ' < "$f" 2>/dev/null | grep -q -F -f {keyfile} && argv=$((argv+1)); done
echo "argv $argv"
echo "journal $(journalctl --no-pager -q 2>/dev/null | grep -c -F -f {keyfile} || true)"
echo "logs $(grep -r -l -F -f {keyfile} /var/log 2>/dev/null | wc -l)"
echo "world-readable $(find /etc /opt /srv /var /home /root /tmp /run -xdev -type f -perm -o+r -size -20M \\
    -exec grep -l -F -f {keyfile} {{}} + 2>/dev/null | wc -l)"
rm -f {keyfile}
"""
        found_all[host] = _status_lines(host_cmd(host, script, timeout=300))
    record("worker-key-exposure", found_all)
    vllm_hosts = {i["host"] for i in inventory["instances"]}
    for host, found in found_all.items():
        assert found["digest"] == digest, (host, "the key on the host is not .cache/worker/api-key")
        if host in vllm_hosts:
            assert re.fullmatch(r"640 root:\S+", found["instance_key_file"]), (host, found)
        if "router_key_file" in found:
            assert found["router_key_file"] == "600 root:root", (host, found)
        for what in ("units", "systemctl_show", "env_records_rollback", "argv", "journal", "logs", "world-readable"):
            assert found[what] == "0", (host, what, found)
