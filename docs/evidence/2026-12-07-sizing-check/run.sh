# issue 34's prediction check on the embedded default, all in one hour on this 2-core machine (run from the repo
# root, the default stack up and verified): capacity searches of 2P1D (inventory/local), 2P2D (inventory/local-2d)
# and 2P3D (a third decode instance: inventory/local-3d made here from local-3d-pd-decode-0.yml, not committed;
# inside inventory/ because the inventories find the clone's keys relative to themselves), each shape deployed onto the
# running one (site.yml adds instances), the front door's admission off for the searches as CI's search has it.
# Decided before measuring: pd_sizing is given 2P1D and 2P2D and predicts 2P3D.
set -euo pipefail
export ANSIBLE_CONFIG=$PWD/ansible.cfg
ev=docs/evidence/2026-12-07-sizing-check
search() {  # $1 inventory, $2 out dir
  .venv/bin/python bench/sla_capacity.py --inventory "$1" --base-url http://10.237.0.13:8000 \
    --prometheus-url http://10.237.0.13:9090 --scrape-interval 15 --tokenizer .cache/model-src/tiny-pd \
    --out-dir "$2" --context-points 1 --start-rate 4 --point-seconds 20 --min-prompts 6 --max-points 7 \
    --precision 0.1 --confirm-failures 1 --warmup-prompts 64 --point-timeout 120 2> "$2.log"
}
date -u +"start %FT%TZ"
.venv/bin/ansible-playbook site.yml -i inventory/local --limit router_hosts --tags router -e pd_frontdoor_max_inflight=0 > /tmp/sz-admission-off.log
search inventory/local reports/capacity/sizing-2p1d
date -u +"2p1d done %FT%TZ"
.venv/bin/ansible-playbook site.yml -i inventory/local-2d -e pd_frontdoor_max_inflight=0 > /tmp/sz-deploy-2d.log
cp reports/local-2d/verify-latest.md "$ev/verify-2p2d.md" 2>/dev/null || true
search inventory/local-2d reports/capacity/sizing-2p2d
date -u +"2p2d done %FT%TZ"
rm -rf inventory/local-3d && mkdir -p inventory/local-3d/host_vars
for f in group_vars hosts.yml testhosts.yml; do ln -s "../local/$f" "inventory/local-3d/$f"; done
ln -s ../../local/host_vars/pd-prefill-0.yml inventory/local-3d/host_vars/
cp "$ev/local-3d-pd-decode-0.yml" inventory/local-3d/host_vars/pd-decode-0.yml
.venv/bin/ansible-playbook site.yml -i inventory/local-3d -e pd_frontdoor_max_inflight=0 > /tmp/sz-deploy-3d.log
search inventory/local-3d reports/capacity/sizing-2p3d
date -u +"2p3d done %FT%TZ"
