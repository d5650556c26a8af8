# The crash matrix again under inventory/local's admission limit of 2026-12-07 (M 6, max rate 8.724 from the capacity
# search with distinct word prompts; the first matrix, docs/evidence/2026-12-07-crash-matrix/, ran under M 10).
# bash docs/evidence/2026-12-07-crash-matrix-m6/run.sh, as run (fresh bring-up of the embedded default, quiet machine).
cd /work/main
mkdir -p /tmp/matrix6
date -u +"up start %FT%TZ"
scripts/testhosts up --env local && .venv/bin/ansible-playbook -i inventory/local site.yml > /tmp/matrix6/site.log 2>&1
echo "site rc=$?"
# Open loop at 0.8 x 8.724 = 6.98 req/s of ~3000-token prompts; a 429 with Retry-After is shed, not failed.
date -u +"open start %FT%TZ"
.venv/bin/python bench/pd_faults.py -i inventory/local --scenarios kill-prefill,kill-prefill-unit,kill-decode,kill-router --rate 6.98 --prompt-words 600 --repeats 5 --shed-ok --out reports/faults/matrix-open-m6.json > /tmp/matrix6/open.log 2>&1
echo "open rc=$?"
# Closed loop of 2 clients (every 429 counted as failed), on the same stack. Stopped by hand after 3 of the 5 rounds
# (22:43 UTC, closed.log ends in round 4's first kill), to leave the machine to the CI check of the same session.
date -u +"closed start %FT%TZ"
.venv/bin/python bench/pd_faults.py -i inventory/local --scenarios kill-prefill,kill-prefill-unit,kill-decode,kill-router --repeats 5 --out reports/faults/matrix-closed-m6.json > /tmp/matrix6/closed.log 2>&1
echo "closed rc=$?"
date -u +"end %FT%TZ"
