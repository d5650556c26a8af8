# Run with bash (kept as the evidence of how the A/B ran).
# A/B of the front door's admission under a CPU hog: new (per-key in-flight cap, r/m rate) vs old.
cd /work/main
H="scripts/testhosts ssh --env local pd-router-0 --"
$H "test -f /root/fd.new || cp /etc/nginx/conf.d/pd-frontdoor.conf /root/fd.new; grep -v 'limit_conn pd_frontdoor_key_inflight' /root/fd.new | sed 's/rate=322r\/m/rate=5r\/s/' > /root/fd.old"
run() { # variant hog tag
  $H "cp /root/fd.$1 /etc/nginx/conf.d/pd-frontdoor.conf && nginx -t -q && systemctl reload nginx" || exit 1
  sleep 3
  if [ "$2" = hog ]; then python3 -c "while True: pass" & HOG=$!; fi
  .venv/bin/python bench/pd_overload.py -i inventory/local --max-rate ${RATE:-11.31} --duration 30 --out reports/overload/ab-$1-$2-$3.json > /tmp/ab-$1-$2-$3.log 2>&1
  [ -n "$HOG" ] && kill $HOG; HOG=
  python3 -c "
import json,sys;r=json.load(open('reports/overload/ab-$1-$2-$3.json'))
k=r['keys'];o=r['overall']
print('$1 $2 $3', 'light', k['light']['sent'], k['light']['shed'], k['light']['admitted_fraction'], 'heavy', k['heavy']['sent'], k['heavy']['shed'], 'ttft', o['admitted_ttft_mean_s'], 'tpot', o['admitted_tpot_mean_ms'], 'goodput', o['goodput_req_s'], '5xx', o['http_5xx'], 'other', o['other_failures'])"
  sleep 10
}
for i in $(seq 1 ${N:-2}); do
  for v in ${VARIANTS:-new old}; do run $v ${HOG_MODE:-hog} $i; done
done
$H "cp /root/fd.new /etc/nginx/conf.d/pd-frontdoor.conf && nginx -t -q && systemctl reload nginx"
