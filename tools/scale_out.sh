#!/usr/bin/env bash
# Issue #35's two targets on one multi-GPU machine (docs/scale-out.md): the same selection on one
# GPU (CUDA_VISIBLE_DEVICES=0) and with --gpus N, each run from empty compile caches of its own,
# timed, then compared point by point (tools/compare_runs.py).
#
#   tools/scale_out.sh OUT [N]     N GPUs (default 4); OUT: a folder for the runs, logs and results
#
#   sweep:    bench of every implementation but compile-max-autotune, serial then --gpus N
#   autotune: warm + bench of compile-max-autotune, serial (warm's own --jobs) then --gpus N
# Writes OUT/<run>/ (benchmark folders), OUT/<run>.log, OUT/<run>.seconds (wall seconds) and
# OUT/<target>-compare.{md,json}. Resumable: a step that ended is skipped when the script runs
# again, and one that LIMIT_S stopped goes on (every bench runs with --resume; its seconds add up).
# Environment: TARGETS ("sweep autotune"), DTYPE (bf16), SHAPES (sweep), OPS (all), IMPL (the
# sweep's, default '*,!compile-max-autotune'), BENCH_ARGS (more bench options, e.g. '--rep-ms 25
# --warmup-ms 5'), REPEAT=1 (a second serial sweep: the run-to-run noise; else the trials' spread),
# LIMIT_S (seconds this invocation may take: a machine lent per command; exit 3 = run it again),
# STEPS (a shell pattern over the step names, e.g. 'sweep-serial': run only those now, the rest on
# a later invocation; the comparison waits for both runs),
# NB (the command; default normbench, else python3 -m harness).
set -uo pipefail
out=${1:?usage: tools/scale_out.sh OUT [N]}
n=${2:-4}
here=$(cd "$(dirname "$0")" && pwd)
read -r -a nb <<< "${NB:-$(command -v normbench >/dev/null && echo normbench || echo python3 -m harness)}"
read -r -a extra <<< "${BENCH_ARGS:-}"
sel=(--dtype "${DTYPE:-bf16}" --shapes "${SHAPES:-sweep}")
[ -n "${OPS:-}" ] && sel+=(--op "$OPS")
mkdir -p "$out"
start=$SECONDS

step() {  # STEP RUN ARGS...: normbench ARGS unless OUT/STEP.done; RUN's caches, log and seconds
  local name=$1 run=$2 t0 rc left lim=()
  shift 2
  [ -e "$out/$name.done" ] && return 0
  # shellcheck disable=SC2254
  case $name in ${STEPS:-*}) ;; *) echo "$name: not in STEPS, left for a later invocation"; return 0 ;; esac
  if [ -n "${LIMIT_S:-}" ]; then
    left=$((LIMIT_S - (SECONDS - start)))
    [ "$left" -lt 60 ] && { echo "out of time before $name: run the script again"; exit 3; }
    lim=(timeout -s INT -k 30 "$left")
  fi
  echo "\$ ${nb[*]} $*" >> "$out/$run.log"
  t0=$(date +%s%N)
  TORCHINDUCTOR_CACHE_DIR="$out/cache-$run/inductor" TRITON_CACHE_DIR="$out/cache-$run/triton" \
    "${lim[@]}" "${nb[@]}" "$@" >> "$out/$run.log" 2>&1
  rc=$?
  awk -v prev="$(cat "$out/$run.seconds" 2>/dev/null || echo 0)" -v ns="$(($(date +%s%N) - t0))" \
    'BEGIN { printf "%.1f\n", prev + ns / 1e9 }' > "$out/$run.tmp" && mv "$out/$run.tmp" "$out/$run.seconds"
  if [ "$rc" -ne 0 ]; then  # stopped by LIMIT_S (130), or a worker died (1): the next run resumes it
    echo "$name: exit $rc after $(cat "$out/$run.seconds") s in all; run the script again to go on (log: $out/$run.log)"
    tail -3 "$out/$run.log"
    exit 3
  fi
  touch "$out/$name.done"
  echo "$name: done, $(cat "$out/$run.seconds") s in all"
}

compare() {  # TARGET SERIAL FANNED [NOISE], once both runs have ended
  [ -e "$out/$2.done" ] || [ -e "$out/$2-bench.done" ] || return 0
  [ -e "$out/$3.done" ] || [ -e "$out/$3-bench.done" ] || return 0
  python3 "$here/compare_runs.py" "$out/$2" "$out/$3" ${4:+--noise "$out/$4"} --wall "$(cat "$out/$2.seconds")" "$(cat "$out/$3.seconds")" \
    --json "$out/$1-compare.json" > "$out/$1-compare.md" && cat "$out/$1-compare.md"
}

for target in ${TARGETS:-sweep autotune}; do
  case $target in
  sweep)
    b=(bench --impl "${IMPL:-*,!compile-max-autotune}" "${sel[@]}" "${extra[@]}" --resume)
    CUDA_VISIBLE_DEVICES=0 step sweep-serial sweep-serial "${b[@]}" --out "$out/sweep-serial"
    step "sweep-gpus$n" "sweep-gpus$n" "${b[@]}" --gpus "$n" --out "$out/sweep-gpus$n"
    noise=
    if [ "${REPEAT:-0}" = 1 ]; then
      CUDA_VISIBLE_DEVICES=0 step sweep-serial2 sweep-serial2 "${b[@]}" --out "$out/sweep-serial2"
      noise=sweep-serial2
    fi
    compare sweep sweep-serial "sweep-gpus$n" $noise
    ;;
  autotune)
    w=(--impl compile-max-autotune "${sel[@]}")
    CUDA_VISIBLE_DEVICES=0 step autotune-serial-warm autotune-serial warm "${w[@]}" --out "$out/autotune-serial"
    CUDA_VISIBLE_DEVICES=0 step autotune-serial-bench autotune-serial bench "${w[@]}" "${extra[@]}" --resume --out "$out/autotune-serial"
    step "autotune-gpus$n-warm" "autotune-gpus$n" warm "${w[@]}" --gpus "$n" --out "$out/autotune-gpus$n"
    step "autotune-gpus$n-bench" "autotune-gpus$n" bench "${w[@]}" "${extra[@]}" --gpus "$n" --resume --out "$out/autotune-gpus$n"
    compare autotune autotune-serial "autotune-gpus$n"
    ;;
  *) echo "unknown target $target (sweep, autotune)" >&2; exit 2 ;;
  esac
done
