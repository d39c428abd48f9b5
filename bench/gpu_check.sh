#!/usr/bin/env bash
# The ONE script run on a GPU machine (H200: Python 3.12, torch 2.11, triton 3.6, pandas, pytest,
# hypothesis; no registry access). It runs from the source tree without installing anything and
# writes everything under $OUT (default ./gpu_out):
#
#   env.txt              nvidia-smi, Python and package versions, CUDA device, git commit
#   pytest.log           TACO_TEST_DEVICE=cuda pytest of the device-facing tests (-x; the step's timeout bounds it)
#   bench.log            output of the kernel benchmarks (and of the TransformerEngine group check, where TE imports)
#   bytes_vs_reference.csv              the kernels' bytes vs the torch reference per codec, dtype and mode
#   kernels_<dev>_<date>.csv            default config (fp8_e4m3, G=128, Hadamard), 1 MiB .. 1 GiB
#   kernels_<dev>_<date>_variants.csv   int8 G=128 and fp8_e4m3 G=256 (as time allows)
#   sweep CSV, autotune.json             the autotune sweep (autotune.json -> autotune/tuned/<gpu>.json)
#   hotpath.csv          the collectives' launches: ms, logical GB/s, % of copy, the model's bound
#   summary.json         status, rc and seconds of every step, plus a digest of the results
#
# That is 10 files, all at the top of $OUT: a small, fixed set to copy into the repository.
# Every step runs under `timeout` and the script goes on when one fails; the whole run keeps
# within GPU_CHECK_BUDGET_S seconds (default 450, inside 8 minutes). summary.json is
# rewritten after every step, so a killed run still leaves one.
#
# Usage:
#   bash bench/gpu_check.sh             # on the GPU machine (OUT=... to choose the folder)
#   bash bench/gpu_check.sh --dry-run   # anywhere (also DRY_RUN=1): prints each step it would run,
#                                       # runs the benchmark in --quick CPU mode under
#                                       # TRITON_INTERPRET=1 into a temporary $OUT
# Environment: OUT, PYTHON (default python3; .venv/bin/python in a dry run when present),
#   GPU_CHECK_BUDGET_S, DRY_RUN.
set -uo pipefail

DRY_RUN=${DRY_RUN:-0}
[[ $DRY_RUN == 1 || $DRY_RUN == true || $DRY_RUN == yes ]] && DRY_RUN=1 || DRY_RUN=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (use --dry-run or --help)" >&2; exit 2 ;;
  esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if (( DRY_RUN )); then
  OUT=$(mktemp -d "${TMPDIR:-/tmp}/taco_gpu_check.XXXXXX")
  if [[ -z ${PYTHON:-} && -x $REPO/.venv/bin/python ]]; then PYTHON=$REPO/.venv/bin/python; fi
else
  OUT=${OUT:-./gpu_out}
fi
PY=${PYTHON:-python3}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
export OUT

BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
RESERVE_S=10                          # kept back for the final summary
START_S=$(date +%s)
STEPS=$(mktemp "${TMPDIR:-/tmp}/taco_gpu_steps.XXXXXX")   # one TSV line per step, outside $OUT
trap 'rm -f "$STEPS"' EXIT

log() { printf '[gpu_check %4ds] %s\n' "$(( $(date +%s) - START_S ))" "$*"; }

# Writes $OUT/summary.json from the steps so far (called after every step).
write_summary() {
  STEPS_FILE=$STEPS DRY=$DRY_RUN BUDGET=$BUDGET_S ELAPSED=$(( $(date +%s) - START_S )) REPO=$REPO \
    timeout 60 "$PY" - <<'PYEOF' || printf '{"error": "summary writer failed (python: %s)"}\n' "$PY" >"$OUT/summary.json"
import csv, datetime, glob, json, os, re
out = os.environ["OUT"]
steps = []
for line in open(os.environ["STEPS_FILE"]):
    name, status, rc, secs, limit, logf, cmd = line.rstrip("\n").split("\t", 6)
    steps.append(dict(name=name, status=status, rc=None if rc == "" else int(rc), seconds=int(secs),
                      timeout_s=int(limit), log=logf, command=cmd))

def pytest_digest():
    p = os.path.join(out, "pytest.log")
    if not os.path.exists(p):
        return None
    lines = [l.strip() for l in open(p, errors="replace") if l.strip() and not l.startswith(("=====", "$ "))]
    tail = [l for l in lines if re.search(r"\b(passed|failed|error|errors|skipped|no tests ran)\b", l)]
    fails = [l for l in lines if l.startswith(("FAILED", "ERROR"))]
    return dict(result=tail[-1] if tail else (lines[-1] if lines else ""), failures=fails[:20])

def f(v):
    if v in ("", None):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return v
    if x != x:
        return None
    return int(x) if x.is_integer() and abs(x) < 2**53 else round(x, 4)

def bench_digest(path):
    rows = list(csv.DictReader(open(path)))
    keep = ("config", "numel", "input_bytes", "median_ms", "logical_gbps", "pct_of_copy",
            "speedup_vs_eager", "speedup_vs_compile", "valid", "note")
    res = dict(csv=os.path.basename(path), rows=len(rows), device=rows[0]["device"] if rows else None,
               git_commit=rows[0]["git_commit"] if rows else None,
               invalid=[f"{r['config']} {r['input_bytes']}B {r['kernel']}/{r['impl']}: {r['valid']} {r['note']}"
                        for r in rows if r["valid"].startswith(("FAIL", "error"))],
               copy_gbps={r["input_bytes"]: f(r["logical_gbps"]) for r in rows if r["impl"] == "copy"})
    for kernel in ("compress", "decompress"):
        res[kernel] = [{k: f(r[k]) for k in keep} | {"impl": r["impl"]}
                       for r in rows if r["kernel"] == kernel and r["impl"] in ("triton", "compile")]
    return res

def bytes_digest():
    p = os.path.join(out, "bytes_vs_reference.csv")
    if not os.path.exists(p):
        return None
    rows = list(csv.DictReader(open(p)))
    verdicts = {}
    for r in rows:
        verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
    bad = [f"{r['kernel']} {r['codec']} {r['dtype']} G{r['G']} hadamard={r['hadamard']} {r['scales']} {r['rounding']} "
           f"n={r['numel']}: {r['note']}" for r in rows if "OUT" in r["verdict"]]
    return dict(csv=os.path.basename(p), cases=len(rows), device=rows[0]["device"] if rows else None,
                verdicts=verdicts, out_of_bound=bad[:20])

summary = dict(
    script="bench/gpu_check.sh", dry_run=os.environ["DRY"] == "1",
    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    elapsed_s=int(os.environ["ELAPSED"]), budget_s=int(os.environ["BUDGET"]), out=out,
    ok=bool(steps) and all(s["status"] in ("ok", "dry-run", "skipped") for s in steps),
    steps=steps, pytest=pytest_digest(), bytes_vs_reference=bytes_digest(),
    bench=[bench_digest(p) for p in sorted(glob.glob(os.path.join(out, "kernels_*.csv")))],
)
tmp = os.path.join(out, ".summary.json.tmp")
with open(tmp, "w") as fh:
    json.dump(summary, fh, indent=1)
os.replace(tmp, os.path.join(out, "summary.json"))
PYEOF
}

record() {  # name status rc seconds limit log command
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$STEPS"
  write_summary
}

# run_step MODE NAME CAP_S MIN_S LOGFILE -- COMMAND...
#   MODE run:  run COMMAND under `timeout` (the smaller of CAP_S and the budget left); skip it when
#              less than MIN_S seconds are left. Output is appended to $OUT/LOGFILE. An argument
#              @BUDGET@ becomes the step's time limit less 20 s (for bench/kernel_speed.py --time-budget).
#   MODE plan: only print COMMAND (the GPU steps of a dry run).
run_step() {
  local mode=$1 name=$2 cap=$3 min=$4 logf=$5; shift 6
  local left=$(( BUDGET_S - RESERVE_S - ($(date +%s) - START_S) ))
  local limit=$(( cap < left ? cap : left ))
  local inner=$(( limit > 40 ? limit - 20 : limit / 2 )) a args=()
  [[ $mode == plan ]] && inner=$(( cap - 20 ))
  for a in "$@"; do args+=("${a//@BUDGET@/$inner}"); done
  set -- "${args[@]}"
  local cmd; cmd=$(printf '%q ' "$@")
  if [[ $mode == plan ]]; then
    log "[$name] would run (timeout ${cap}s): $cmd > \$OUT/$logf"
    record "$name" dry-run "" 0 "$cap" "$logf" "$cmd"
    return 0
  fi
  if (( limit < min )); then
    log "[$name] SKIPPED: ${left}s of the ${BUDGET_S}s budget left, step needs >= ${min}s"
    record "$name" skipped "" 0 "$limit" "$logf" "$cmd"
    return 0
  fi
  log "[$name] running (timeout ${limit}s): $cmd > \$OUT/$logf"
  printf '\n===== [%s] %s (timeout %ss)\n$ %s\n' "$name" "$(date -u +%FT%TZ)" "$limit" "$cmd" >>"$OUT/$logf"
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$logf" 2>&1
  local rc=$?
  local secs=$(( $(date +%s) - t0 )) status=ok
  if (( rc == 124 || rc == 137 )); then status=timeout; elif (( rc != 0 )); then status=failed; fi
  printf '===== [%s] %s: rc=%s after %ss\n' "$name" "$status" "$rc" "$secs" >>"$OUT/$logf"
  log "[$name] $status (rc=$rc, ${secs}s)"
  record "$name" "$status" "$rc" "$secs" "$limit" "$logf" "$cmd"
}

log "repo $REPO | OUT=$OUT | python $PY | budget ${BUDGET_S}s | dry-run=$DRY_RUN"
GPU=run; (( DRY_RUN )) && GPU=plan

# 1. The machine.
run_step "$GPU" nvidia_smi 20 5 env.txt -- nvidia-smi
run_step "$GPU" nvidia_smi_query 20 5 env.txt -- nvidia-smi \
  --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu \
  --format=csv
run_step run python_env 60 5 env.txt -- "$PY" bench/kernel_speed.py --print-env

# 2. The test suite on the GPU.
# The device-facing tests only (the CPU-process suites - collectives on gloo, training, notebooks -
# gain nothing from a GPU and would not fit the step's time).
run_step "$GPU" pytest 170 30 pytest.log -- env TACO_TEST_DEVICE=cuda "$PY" -m pytest tests/test_kernels.py \
  tests/test_properties.py tests/test_api.py tests/test_reference.py tests/test_serialization.py -q -x \
  -p no:cacheprovider

# ---------------------------------------------------------------------------------------------
# 2b. The host path around the kernels: the compressed collectives and p2p captured in CUDA
#     graphs and replayed (same bytes as eager, no host sync in the steady state under
#     torch.cuda.set_sync_debug_mode("error")), on a one-rank NCCL group with
#     TACO_TRITON_COMPRESS_SINGLE_RANK=1 set by the tests; and two replays of a stochastic
#     all_reduce and p2p message round differently (fresh seeds per replay: its own kernels
#     to compile, hence 150 s); async collectives captured too (the communication stream forked
#     and joined inside the capture), two of them in flight into non-contiguous outputs while the
#     capturing stream allocates (their contiguous copies held until the join); and a Work waited
#     on a side stream, then on the current one, read there at once (every wait() orders its
#     stream). Appended to pytest.log.
run_step "$GPU" cuda_graphs 150 30 pytest.log -- env TACO_TEST_DEVICE=cuda "$PY" -m pytest tests/test_cuda_graphs.py \
  -q -x -rs -p no:cacheprovider
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# 2b'. Async overlap: a 64 MiB async compressed all_reduce issued before a GEMM of about its
#     duration on the current stream takes at most 1.2x the longer of the two alone (one-rank
#     NCCL group; device time, measured while the host has issued everything). The times are in
#     the assertion message of a failure. Appended to pytest.log.
run_step "$GPU" async_overlap 90 30 pytest.log -- env TACO_TEST_DEVICE=cuda "$PY" -m pytest tests/test_gpu_overlap.py \
  -q -x -rs -p no:cacheprovider
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# 2c. The kernels' bytes against the torch reference (bench/gpu_bytes.py): compress, decompress
#     and the fused reduce for every codec, dtype, Hadamard, scale layout and rounding at
#     G = 32, 128, 256, in a fixed shuffled order until its time budget; a verdict per case
#     (identical / differ within bound / differ OUT of bound), rc 1 if any case is out of bound.
#     Dry run: Triton's interpreter on a tiny set.
if (( DRY_RUN )); then
  run_step plan bytes_vs_reference 60 30 bench.log -- "$PY" bench/gpu_bytes.py --time-budget @BUDGET@ \
    --csv "$OUT/bytes_vs_reference.csv"
  run_step run bytes_vs_reference_cpu_tiny 120 30 bench.log -- env TRITON_INTERPRET=1 "$PY" bench/gpu_bytes.py \
    --device cpu --codecs fp8_e4m3,int4 --dtypes fp16 --group-sizes 32 --roundings nearest --sizes 1000 \
    --csv "$OUT/bytes_vs_reference.csv"
else
  run_step run bytes_vs_reference 60 30 bench.log -- "$PY" bench/gpu_bytes.py --time-budget @BUDGET@ \
    --csv "$OUT/bytes_vs_reference.csv"
fi
# ---------------------------------------------------------------------------------------------

# 3. The kernel benchmark: default config, 1 MiB .. 1 GiB of bf16.
SIZES=1M,4M,16M,64M,256M,1G
if (( DRY_RUN )); then
  run_step plan bench_kernels 150 40 bench.log -- "$PY" bench/kernel_speed.py --sizes "$SIZES" --time-budget @BUDGET@ --csv "$OUT/"
  run_step run bench_kernels_cpu_quick 240 40 bench.log -- env TRITON_INTERPRET=1 "$PY" bench/kernel_speed.py --quick \
    --csv "$OUT/"
else
  run_step run bench_kernels 150 40 bench.log -- "$PY" bench/kernel_speed.py --sizes "$SIZES" --time-budget @BUDGET@ \
    --csv "$OUT/"
fi

# 3b. The collectives' own launches (bench/hotpath_speed.py): the slotted compress, the tagged
#     reduce and the slotted decompress of all_reduce, reduce_scatter and all_gather as rank 0 of
#     P = 2, 4, 8, 16 builds them, 16 and 64 MiB, aligned and odd, FP8 and INT8: median ms, logical
#     GB/s, % of a copy of the same bytes and the compile-time model's bound (hotpath.csv).
run_step "$GPU" bench_hotpath 90 30 bench.log -- "$PY" bench/hotpath_speed.py --repeats 1 --time-budget @BUDGET@ \
  --csv "$OUT/hotpath.csv"

# 4. The autotune sweep of the main shapes (hidden 4096 and 8192, 4096..65536 tokens, bf16, G=128):
#    writes the sweep CSV and $OUT/autotune.json, which becomes autotune/tuned/<gpu>.json.
run_step "$GPU" autotune 120 60 bench.log -- "$PY" -m autotune.sweep --kernel compress,decompress,reduce \
  --shapes 4096x4096,16384x4096,65536x4096,4096x8192,65536x8192 --dtype bf16 --group-size 128 \
  --time-budget @BUDGET@ --csv "$OUT/" --cache "$OUT/autotune.json"

# ---------------------------------------------------------------------------------------------
# 4b. TransformerEngine through the compressing process group (bench/te_group_check.py), only
#     where transformer_engine imports: a column- and a row-parallel te.Linear on 2 ranks, plain TP
#     group vs taco.compressed_group(tp_group); output appended to bench.log (no new file).
#     Without TE the step is recorded as skipped and nothing runs.
if "$PY" -c 'import transformer_engine.pytorch' >/dev/null 2>&1; then
  run_step "$GPU" te_group 90 40 bench.log -- "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 \
    bench/te_group_check.py
else
  log "[te_group] SKIPPED: transformer_engine is not importable with $PY"
  record te_group skipped "" 0 0 bench.log "transformer_engine not importable"
fi
# ---------------------------------------------------------------------------------------------

# 5. Variants (int8, G=256) with the time that is left. $OUT now holds its 10 files.
run_step "$GPU" bench_variants 110 40 bench.log -- "$PY" bench/kernel_speed.py --sizes "$SIZES" --time-budget @BUDGET@ \
  --config int8:128 --config fp8_e4m3:256 --tag variants --csv "$OUT/"

write_summary
log "done in $(( $(date +%s) - START_S ))s; results in $OUT:"
ls -l "$OUT" | sed 's/^/    /'
if (( DRY_RUN )); then log "dry run: nothing ran on a GPU; the files above are CPU/interpreter output"; fi
"$PY" -c 'import json, sys; s = json.load(open(sys.argv[1])); print("overall ok:", s.get("ok"))' "$OUT/summary.json" \
  2>/dev/null || true
