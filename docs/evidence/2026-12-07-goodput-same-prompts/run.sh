#!/usr/bin/env bash
# issue 31's overload benchmark, with the capacity search and the overload sending the same kind of request: the
# search's prompts distinct filler words (--prompts words, now the default) as pd_overload's are, against the
# search's old prompts (vLLM's random dataset: on the tiny model's 512-token vocabulary a third of its prompt tokens
# were prefix-cache hits, which pd_overload's prompts never get). Same hour, embedded default, quiet machine, run
# from the repo root on a running stack. For each kind: the search (3072 tokens, 30-s points, as in docs/faults.md)
# with the front door's admission off, then its admission limit deployed, then RUNS x 60 s of overload at 3 x its
# max rate from two keys (2.7x and 0.3x). Ends with the inventory's own admission limit deployed again.
set -euo pipefail
export ANSIBLE_CONFIG=$PWD/ansible.cfg
INV=${INV:-inventory/local}
KINDS=${KINDS:-"words random"}
RUNS=${RUNS:-3}
ev=docs/evidence/2026-12-07-goodput-same-prompts
router_play() { .venv/bin/ansible-playbook site.yml -i "$INV" --limit router_hosts --tags router "$@"; }
for kind in $KINDS; do
  out=reports/capacity/goodput-$kind
  rm -rf "$out"
  router_play -e pd_frontdoor_max_inflight=0 > "/tmp/goodput-$kind-admission-off.log"
  date -u +"$kind search start %FT%TZ"
  .venv/bin/python bench/sla_capacity.py --inventory "$INV" --base-url http://10.237.0.13:8000 \
    --prometheus-url http://10.237.0.13:9090 --scrape-interval 15 --tokenizer .cache/model-src/tiny-pd \
    --out-dir "$out" --contexts 3072 --start-rate 8 --point-seconds 30 --max-prompts 1000 --max-points 7 \
    --prompts "$kind" --admission-file "$out/admission.yml" 2> "$out.log" || true
  cp "$out/report.md" "$ev/search-$kind.md"; cp "$out/report.json" "$ev/search-$kind.json"
  cp "$out/admission.yml" "$ev/admission-$kind.yml"
  router_play -e "@$out/admission.yml" > "/tmp/goodput-$kind-admission-on.log"
  for i in $(seq 1 "$RUNS"); do
    date -u +"$kind overload $i %FT%TZ"
    .venv/bin/python bench/pd_overload.py -i "$INV" --capacity-report "$out/report.json" --duration 60 \
      --out "$ev/overload-$kind-$i.json" > "$ev/overload-$kind-$i.txt" 2>&1 || true
    cat "$ev/overload-$kind-$i.txt"
    sleep 20
  done
done
router_play > /tmp/goodput-admission-restore.log
date -u +"done %FT%TZ"
