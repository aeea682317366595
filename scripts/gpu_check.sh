#!/usr/bin/env bash
# One-call GPU check, run from the repository root on the GPU machine (device tool, carry .whl):
#   1. installs the carried wheels (.whl/*.whl: flashinfer-python 0.6.1, apache-tvm-ffi 0.1.7)
#      into /tmp/site, with FlashInfer modules of an earlier call (scripts/gpu_env.sh);
#   2. runs the attention conformance suite (tests/attention) on cuda, every registered backend;
#   3. runs `attnserve bench kernels`;
#   4. runs `attnserve bench throughput` (the standard offline workload, dummy weights) per backend;
#   5. runs scripts/gpu_parity.py (engine vs HF greedy tokens per backend, graphs on and off).
# Logs go to $OUT (conformance.log, bench.log, bench.json, env.log); the exit status is non-zero
# if a stage failed.
#
# Knobs (environment):
#   STAGES              which stages run (default "conformance kernels throughput parity").
#   CONFORMANCE_WORKERS pytest-xdist workers for stage 2 (default 1): FlashInfer and flex
#                       variants then compile in parallel.
#   PARITY_ARGS         arguments of scripts/gpu_parity.py (default: its defaults).
#   CONFORMANCE_SELECT  extended regex over collected test ids; only matching tests run. The
#                       default fits one 10-minute call: every cuda test of TORCH_SDPA, TRITON
#                       and the ONE_FILE example; FLASHINFER's bf16 head-size-128 cases; three
#                       FLEX_ATTENTION cases. '-cuda' selects every cuda test (the full grid needs
#                       ~30 min of compilation on a fresh machine: split it over calls).
#   CONFORMANCE_TIMEOUT seconds for stage 2 (default 400); BENCH_TIMEOUT for stage 3 (default 160).
#   BENCH_BACKENDS      comma-separated backends for the bench (default: all that fit).
#   THROUGHPUT_BACKENDS space-separated backends for stage 4 (default TRITON; empty skips it);
#   THROUGHPUT_MODEL (default qwen3-0.6b), THROUGHPUT_TIMEOUT (default 240 per backend),
#   THROUGHPUT_ARGS extra arguments (default: HF baseline on 16 of the prompts).
# Just-in-time compilation dominates a fresh machine: FlashInfer builds one module per (dtype,
# head size, window, soft-cap) variant, ~100 s for a prefill variant plus ~10 s for its decode
# one; torch.compile of flex attention takes ~15-20 s per new configuration.
set -uo pipefail

OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
    python3 -m attnserve.cli backends --dtype bfloat16 --device cuda
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

status=0
stages=" ${STAGES:-conformance kernels throughput parity} "
default_select='(TORCH_SDPA|TRITON|ONE_FILE)-cuda'
default_select+='|FLASHINFER-cuda(\]|-block|-Case\(.*head_size=128, block_size=[0-9]+, dtype=torch.bfloat16)'
default_select+='|FLEX_ATTENTION-cuda(\]|-block|-Case\(.*seed=(9|25|34)\))'
select_re="${CONFORMANCE_SELECT:-$default_select}"
if [[ $stages == *" conformance "* ]]; then
mapfile -t tests < <(python3 -m pytest --collect-only -q -o addopts= -p no:cacheprovider tests/attention \
    2>/dev/null | grep -E '::' | grep -E -- "$select_re")
echo "== conformance on cuda: ${#tests[@]} tests (select: $select_re)"
start=$SECONDS
timeout "${CONFORMANCE_TIMEOUT:-400}" python3 -m pytest -o addopts= -v -p no:cacheprovider -p no:benchmark -rfE \
    -n "${CONFORMANCE_WORKERS:-1}" --durations=15 "${tests[@]}" >"$OUT/conformance.log" 2>&1 \
    || status=1
echo "conformance: rc=$status in $((SECONDS - start)) s"
grep -E "FAILED|ERROR|passed|failed" "$OUT/conformance.log" | cut -c1-220 | tail -n 40
fi

if [[ $stages == *" kernels "* ]]; then
echo "== bench kernels"
start=$SECONDS
bench_args=(--json "$OUT/bench.json")
[ -n "${BENCH_BACKENDS:-}" ] && bench_args+=(--backends "$BENCH_BACKENDS")
timeout "${BENCH_TIMEOUT:-160}" python3 -m attnserve.cli bench kernels "${bench_args[@]}" \
    >"$OUT/bench.log" 2>&1 || status=1
echo "bench: in $((SECONDS - start)) s"
cat "$OUT/bench.log"
fi

[[ $stages == *" throughput "* ]] || THROUGHPUT_BACKENDS=""
for backend in ${THROUGHPUT_BACKENDS-TRITON}; do
    echo "== bench throughput ($backend)"
    start=$SECONDS
    # shellcheck disable=SC2086  # THROUGHPUT_ARGS is a list of words
    timeout "${THROUGHPUT_TIMEOUT:-240}" python3 -m attnserve.cli bench throughput \
        --model "${THROUGHPUT_MODEL:-qwen3-0.6b}" --load-format dummy --attention-backend "$backend" \
        --num-prompts 256 --min-len 100 --max-len 1024 \
        ${THROUGHPUT_ARGS---hf-baseline --hf-num-prompts 16 --hf-batch-size 16} \
        --json "$OUT/throughput-$backend.json" >"$OUT/throughput-$backend.log" 2>&1 || status=1
    echo "throughput ($backend): in $((SECONDS - start)) s"
    tail -n 20 "$OUT/throughput-$backend.log"
done

if [[ $stages == *" parity "* ]]; then
    echo "== engine vs HF greedy parity"
    start=$SECONDS
    # shellcheck disable=SC2086  # PARITY_ARGS is a list of words
    timeout "${PARITY_TIMEOUT:-300}" python3 scripts/gpu_parity.py ${PARITY_ARGS-} \
        --json "$OUT/parity.json" >"$OUT/parity.log" 2>&1 || status=1
    echo "parity: in $((SECONDS - start)) s"
    grep -v "^\[" "$OUT/parity.log" | tail -n 30
fi
exit $status
