#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU host, run from the repository root (no internet, no ray needed):
#   1. greedy parity: llama-3-8b shape, dummy weights, bf16, 16 tokens of 4 prompts at TP=1 and
#      TP=2 (NCCL), each in its own process; prints where each prompt diverges, if it does
#      (bf16 all-reduces sum partial products in another order, so late divergence is expected);
#   2. `attnserve bench throughput` at TP=1 and TP=2 (a small fixed workload);
#   3. `attnserve bench latency` at TP=1 and TP=2, if this checkout has that command.
# Logs go to $OUT: env.log, parity_tp{1,2}.log/.json, parity.log, throughput_tp{1,2}.log/.json,
# latency_tp{1,2}.log. Each stage has a time limit, so the whole run stays under ~8 minutes.
# The exit status is non-zero if a stage failed (a parity divergence alone is not a failure:
# parity.log says where it is).
set -uo pipefail

OUT="${OUT:-/tmp/gpu_tp_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="src:."
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0
MODEL="${TP_MODEL:-llama-3-8b}"
THROUGHPUT_ARGS="${THROUGHPUT_ARGS:---num-prompts 128 --input-len 512 --output-len 128}"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nvidia-smi topo -m
    python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

status=0
run() {  # run NAME SECONDS COMMAND...: log to $OUT/NAME.log, note a failure
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s"
    tail -n 12 "$OUT/$name.log"
    [ "$rc" -eq 0 ] || status=1
    return "$rc"
}

for tp in 1 2; do
    run "parity_tp$tp" 150 python3 scripts/tp_parity.py --model "$MODEL" \
        --tensor-parallel-size "$tp" --out "$OUT/parity_tp$tp.json"
done
if [ -f "$OUT/parity_tp1.json" ] && [ -f "$OUT/parity_tp2.json" ]; then
    python3 scripts/tp_parity.py --compare "$OUT/parity_tp1.json" "$OUT/parity_tp2.json" \
        | tee "$OUT/parity.log"
fi

for tp in 1 2; do
    # shellcheck disable=SC2086
    run "throughput_tp$tp" 120 python3 -m attnserve.cli bench throughput --model "$MODEL" \
        --load-format dummy --tensor-parallel-size "$tp" $THROUGHPUT_ARGS \
        --json "$OUT/throughput_tp$tp.json"
done

if python3 -m attnserve.cli bench latency --help >/dev/null 2>&1; then
    for tp in 1 2; do
        run "latency_tp$tp" 75 python3 -m attnserve.cli bench latency --model "$MODEL" \
            --load-format dummy --tensor-parallel-size "$tp"
    done
else
    echo "== bench latency: not in this checkout, skipped" | tee "$OUT/latency_tp1.log"
fi

echo "gpu_tp_check: status $status (logs in $OUT)"
exit "$status"
