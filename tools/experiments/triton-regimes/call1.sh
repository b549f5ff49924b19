#!/usr/bin/env bash
# One device call: correctness (harness check) and compiles in parallel, then timings, then the
# small-row winners pinned and checked. Stages bounded so the call ends in time.
. .devslim/setup.sh > $OUT/setup.log 2>&1
export PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $OUT/env.txt
mkdir -p /tmp/chk
for dt in bf16 fp16 fp32; do
  for sets in edge,between small,perhead; do
    timeout 160 python3 -m harness check --impl triton --shapes $sets --dtype $dt --quiet --json /tmp/chk/check-$dt-${sets%%,*}.json > /tmp/chk/check-$dt-${sets%%,*}.log 2>&1 &
  done
done
for i in $(seq 0 9); do timeout 160 python3 tools/experiments/triton-regimes/explore.py warm $i 10 > /tmp/chk/warm$i.log 2>&1 & done
wait
echo "stage A done at $(( $(date +%s) - T0 )) s" >> $OUT/env.txt
timeout 125 python3 tools/experiments/triton-regimes/explore.py time $OUT/explore 75 110 > /tmp/chk/time.log 2>&1
echo "stage B done at $(( $(date +%s) - T0 )) s" >> $OUT/env.txt
cp impls/triton/configs.json /tmp/chk/configs-pinned.json
for dt in bf16 fp16 fp32; do
  timeout 50 python3 -m harness check --impl triton --shapes small,perhead --dtype $dt --quiet --json /tmp/chk/final-$dt.json > /tmp/chk/final-$dt.log 2>&1 &
done
wait
echo "stage C done at $(( $(date +%s) - T0 )) s" >> $OUT/env.txt
tar czf $OUT/checks.tar.gz -C /tmp chk
grep -h "passed\|failed" /tmp/chk/*.log | tail -20
cat $OUT/env.txt
tail -5 /tmp/chk/time.log
