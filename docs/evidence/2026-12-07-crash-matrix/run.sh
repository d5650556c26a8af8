# The crash matrix of 2026-12-07 (bash docs/evidence/2026-12-07-crash-matrix/run.sh), as run.
cd /work/main
date -u +"closed start %FT%TZ"
.venv/bin/python bench/pd_faults.py -i inventory/local --scenarios kill-prefill,kill-prefill-unit,kill-decode,kill-router --repeats 5 --out reports/faults/matrix-closed.json > /tmp/matrix/closed.log 2>&1
echo "closed rc=$?"
date -u +"open start %FT%TZ"
.venv/bin/python bench/pd_faults.py -i inventory/local --scenarios kill-prefill,kill-prefill-unit,kill-decode,kill-router --rate 11.74 --prompt-words 600 --repeats 5 --shed-ok --out reports/faults/matrix-open.json > /tmp/matrix/open.log 2>&1
echo "open rc=$?"
date -u +"end %FT%TZ"
