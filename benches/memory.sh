#!/usr/bin/env bash
# The embedded store's memory (issue 39): what the release sidecar holds
# while records are loaded, after a kill -9 and restart on that data, and
# while the reaper removes the half that expired. Prints one line per
# figure and writes benches/results/memory.jsonl.
#
#   benches/memory.sh [--records N] [--answers N] [--answer-bytes B]
#                     [--variant 'NAME|FLAGS[|ENV[|BINARY]]']... [--quick]
#                     [--dedupd PATH]
#                     [--scenario records|answers]...
#
# Two scenarios, each on a fresh data directory and run once per variant
# (side by side, so a figure is compared with its neighbours of the same
# run): `records` (N claims+commits without answers, batches of 1 000) and
# `answers` (N commits with B-byte answers, batches of 100). Half of each is
# claimed in a namespace kept 20 s, half in one kept 24 h, so the reaper
# has half to remove once the short ones expire.
#
# Figures per scenario and variant:
# - load: peak RSS (VmHWM) while loading and RSS at the end;
# - reap: peak RSS from the end of the load until the reaper has removed
#   the expired half (in the same process: the short half expires while
#   the long one loads), the time that took, and the entries the reaper
#   read from the start (dedupd_reaper_examined_entries) for the records
#   it removed (dedupd_reaped_records);
# - open: peak RSS from exec to the first answered Lookup after a kill -9
#   (sled's open and the write-ahead log's replay), and the time it took;
# - crash sweep: after that open, the entries the reaper reads until it
#   has counted the records (a start after anything but a clean stop
#   sweeps the store once), its peak RSS and time;
# - disk bytes per record after the reap.
#
# Defaults: 1 000 000 records and 131 072 answers of 8 KiB (1 GiB);
# --quick: 100 000 and 8 192. Variants default to the defaults (the memory
# budget from this machine's cgroup limit, else 128 MiB) and
# `--memory-budget 64MiB`. A variant's ENV (VAR=VALUE ..., optional) is
# the sidecar's environment on top of this one: for instance
# `_RJEM_MALLOC_CONF=dirty_decay_ms:0` tries another jemalloc setting.
# A variant's BINARY runs another build of the sidecar for that variant
# (the one before a change, side by side with the one after; from 59ff78f
# on: the reap phase ends on the records count, which older builds kept
# only every 30 s).
# --dedupd runs another build of the sidecar (for
# instance one built with `--features heap-profile`, docs/memory.md).
set -euo pipefail
invoked_from=$PWD
cd "$(dirname "$0")/.."
. benches/lib.sh

records=1000000 answers=131072 answer_bytes=8192 variants=() sidecar_bin="" scenarios=()
while [ $# -gt 0 ]; do
  case "$1" in
    --records) records=$2; shift 2 ;;
    --answers) answers=$2; shift 2 ;;
    --answer-bytes) answer_bytes=$2; shift 2 ;;
    --variant) variants+=("$2"); shift 2 ;;
    --quick) records=100000 answers=8192; shift ;;
    --dedupd) sidecar_bin=$(cd "$invoked_from" && realpath "$2"); shift 2 ;;
    --scenario) scenarios+=("$2"); shift 2 ;;
    *) bench_unknown "$1" ;;
  esac
done
[ ${#variants[@]} -gt 0 ] || variants=("default|" "budget 64MiB|--memory-budget 64MiB")
[ ${#scenarios[@]} -gt 0 ] || scenarios=(records answers)
if [ -n "$sidecar_bin" ]; then
  bench_build -p dedupd-bench
  bin=$sidecar_bin
else
  bench_build
fi

port=51020 metrics_port=51021
results=$work/memory.jsonl

# start FLAGS...: the sidecar on the bench ports (with the variant's
# environment, $variant_env), its pid in $sidecar.
start() {
  env "${variant_env[@]}" "${variant_bin:-$bin}" --listen 127.0.0.1:$port --metrics-listen 127.0.0.1:$metrics_port \
    --data-dir "$work/data" --sync always --worker-threads 1 --log warn \
    --namespace-retention short=20s --reaper-interval 1s "$@" 2>>"$work/sidecar.log" &
  sidecar=$!
  pids+=("$sidecar")
}

answered() { "$bin" lookup --addr 127.0.0.1:$port -n bench probe >/dev/null 2>&1; }

# until_answered: waits (up to 60 s) for the sidecar's first answer.
until_answered() {
  local deadline=$((SECONDS + 60))
  until answered; do
    if ! kill -0 "$sidecar" 2>/dev/null || [ $SECONDS -gt $deadline ]; then
      echo "the sidecar did not start (its log: $work/sidecar.log):" >&2
      tail -5 "$work/sidecar.log" >&2
      exit 1
    fi
    sleep 0.01
  done
}

# status FIELD: a /proc status figure of the sidecar, in KiB.
status() { awk -v field="$1:" '$1 == field {print $2}' /proc/"$sidecar"/status; }

# metric NAME: one sample from /metrics (0 when absent).
metric() {
  curl -sf "http://127.0.0.1:$metrics_port/metrics" \
    | awk -v name="$1" '$1 == name {print $2; found=1} END {if (!found) print 0}'
}

# reset_peak: VmHWM counts from now (Linux ≥ 4.0: writing 5 to clear_refs).
reset_peak() { echo 5 > /proc/"$sidecar"/clear_refs; }

# until_records N WHAT: waits (up to 10 minutes) until dedupd_records is N.
until_records() {
  local deadline=$((SECONDS + 600))
  until [ "$(metric dedupd_records)" -eq "$1" ]; do
    if ! kill -0 "$sidecar" 2>/dev/null; then
      echo "the sidecar died (its log: $work/sidecar.log):" >&2
      tail -5 "$work/sidecar.log" >&2
      exit 1
    fi
    if [ $SECONDS -gt $deadline ]; then
      echo "$2 in 10 minutes ($(metric dedupd_records) left)" >&2
      exit 1
    fi
    sleep 0.2
  done
}

# reaper_phase N WHAT: from a fresh peak until dedupd_records is N; sets
# phase_seconds, phase_examined (the reaper's entries since the sidecar
# started) and phase_peak (KiB).
reaper_phase() {
  reset_peak
  local from=$(date +%s.%N)
  until_records "$1" "$2"
  phase_seconds=$(python3 -c "print(round($(date +%s.%N) - $from, 1))")
  phase_examined=$(metric dedupd_reaper_examined_entries_total)
  phase_peak=$(status VmHWM)
}

load() { # NAMESPACE COUNT EXTRA...
  local namespace=$1 count=$2
  shift 2
  "$bench" load --target dedupd://127.0.0.1:$port --workload batch-commit \
    --namespace "$namespace" --concurrency 4 --requests "$count" --worker-threads 1 \
    --json "$@" > "$work/load.json"
}

run() { # SCENARIO VARIANT_NAME COUNT FLAGS [ENV [BINARY]]
  local scenario=$1 name=$2 count=$3 flags=()
  read -r -a flags <<< "$4"
  read -r -a variant_env <<< "${5:-}"
  variant_bin=${6:+$(cd "$invoked_from" && realpath "$6")}
  local extra=()
  if [ "$scenario" = answers ]; then
    extra=(--batch-size 100 --response-bytes "$answer_bytes")
  else
    extra=(--batch-size 1000)
  fi
  rm -rf "$work/data"
  start "${flags[@]}"
  until_answered
  # The first reaper pass, which counts the (no) records, before the load:
  # a count taken while records are created is approximate.
  until [ "$(metric dedupd_reaper_passes_total)" -ge 1 ]; do sleep 0.1; done
  local started=$(date +%s.%N)
  load short $((count / 2)) "${extra[@]}"
  load bench $((count - count / 2)) "${extra[@]}"
  # Records the long half wrote (whole batches: a little over its share).
  local kept
  kept=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['ops'])" "$work/load.json")
  local load_seconds=$(python3 -c "print(round($(date +%s.%N) - $started, 1))")
  local load_peak=$(status VmHWM) load_rss=$(status VmRSS)

  # The short half expires 20 s after it was committed (during the long
  # half's load); the reaper runs every second. Done when the records
  # left are the long half's (the count the reaper keeps).
  reaper_phase "$kept" "the reaper did not come down to the $kept records kept"
  local reap_seconds=$phase_seconds examined=$phase_examined reap_peak=$phase_peak
  local reaped=$(metric dedupd_reaped_records_total) reap_rss=$(status VmRSS)

  kill -KILL "$sidecar"; wait "$sidecar" 2>/dev/null || true
  started=$(date +%s.%N)
  start "${flags[@]}"
  until_answered
  local open_seconds=$(python3 -c "print(round($(date +%s.%N) - $started, 2))")
  local open_peak=$(status VmHWM) open_rss=$(status VmRSS)
  # What a start after a crash costs the reaper (the count comes from its
  # first whole sweep).
  reaper_phase "$kept" "the records were not counted after the crash"
  local crash_sweep_seconds=$phase_seconds crash_sweep_examined=$phase_examined
  local crash_sweep_peak=$phase_peak
  kill -TERM "$sidecar"; wait "$sidecar" 2>/dev/null || true
  local disk=$(du -sb "$work/data" | cut -f1)

  python3 - "$scenario" "$name" "$count" "$load_seconds" "$load_peak" "$load_rss" \
    "$open_seconds" "$open_peak" "$open_rss" "$reap_seconds" "$reap_peak" "$reap_rss" \
    "$examined" "$disk" "$answer_bytes" "$kept" "$reaped" "$crash_sweep_seconds" \
    "$crash_sweep_examined" "$crash_sweep_peak" >> "$results" <<'PY'
import json, sys
a = sys.argv[1:]
mib = lambda kib: round(int(kib) / 1024, 1)
row = {
    "scenario": a[0], "variant": a[1], "count": int(a[2]),
    "answer_bytes": int(a[14]) if a[0] == "answers" else 0,
    "load_seconds": float(a[3]), "load_peak_mib": mib(a[4]), "load_rss_mib": mib(a[5]),
    "open_seconds": float(a[6]), "open_peak_mib": mib(a[7]), "open_rss_mib": mib(a[8]),
    "reap_seconds": float(a[9]), "reap_peak_mib": mib(a[10]), "reap_rss_mib": mib(a[11]),
    "reaper_examined": int(a[12]), "reaped": int(a[16]),
    "crash_sweep_seconds": float(a[17]), "crash_sweep_examined": int(a[18]),
    "crash_sweep_peak_mib": mib(a[19]),
    "disk_bytes_per_live_record": round(int(a[13]) / int(a[15])),
}
print(json.dumps(row))
print(" ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr)
PY
}

for scenario in "${scenarios[@]}"; do
  case "$scenario" in
    records) count=$records ;;
    answers) count=$answers ;;
    *) bench_unknown "--scenario $scenario" ;;
  esac
  for variant in "${variants[@]}"; do
    IFS='|' read -r name flags env_vars variant_binary <<< "$variant"
    run "$scenario" "$name" "$count" "$flags" "$env_vars" "$variant_binary"
  done
done
mkdir -p benches/results
cp "$results" benches/results/memory.jsonl
echo "wrote benches/results/memory.jsonl"
