#!/usr/bin/env bash
# issue 31: does the front door's in-flight count (nginx limit_conn) refuse a closed loop that never has more requests
# in flight than the limit? Two closed-loop clients (each sends its next request as soon as its previous answer
# has arrived), one key, through the front door, for DURATION s at each admission limit M in MS, no fault. Two
# requests in flight never exceed M >= 2, so every 429 here is a count nginx had not yet released. nginx names the
# zone that refused in its error log (limit_conn_log_level warn). Run from the repo root on a running stack;
# ends with the inventory's own limit deployed again.
set -euo pipefail
export ANSIBLE_CONFIG=$PWD/ansible.cfg
INV=${INV:-inventory/local-2d}
MS=${MS:-"2 3"}
DURATION=${DURATION:-120}
ev=docs/evidence/2026-12-07-admission-race
url=http://10.237.0.13:8000
router() { scripts/testhosts ssh --env local pd-router-0 -- "$1"; }
for m in $MS; do
  .venv/bin/ansible-playbook site.yml -i "$INV" --limit router_hosts --tags router \
    -e pd_frontdoor_max_inflight="$m" > "/tmp/race-deploy-m$m.log"
  router "journalctl -u nginx --rotate >/dev/null 2>&1; : > /var/log/nginx/error.log; : > /var/log/nginx/pd-frontdoor-access.log"
  date -u +"M=$m start %FT%TZ"
  .venv/bin/python bench/pd_load.py --url "$url" --model tiny-pd --concurrency 2 --duration "$DURATION" \
    --max-tokens 8 --prompt-words 32 --max-failed 1000000 --out "$ev/load-m$m.json" > "$ev/load-m$m.txt" 2>&1 || true
  router "grep -c 'limiting connections' /var/log/nginx/error.log; grep 'limiting connections' /var/log/nginx/error.log | sed -E 's/.*limiting connections( by zone \"[^\"]+\")?.*/\1/' | sort | uniq -c; grep -o 'status=[0-9]*' /var/log/nginx/pd-frontdoor-access.log | sort | uniq -c" > "$ev/nginx-m$m.txt" 2>&1 || true
  router "grep -B3 'status=429' /var/log/nginx/pd-frontdoor-access.log | head -40" > "$ev/access-429-m$m.txt" 2>&1 || true
  cat "$ev/load-m$m.txt" "$ev/nginx-m$m.txt"
done
.venv/bin/ansible-playbook site.yml -i "$INV" --limit router_hosts --tags router > /tmp/race-deploy-restore.log
date -u +"done %FT%TZ"
