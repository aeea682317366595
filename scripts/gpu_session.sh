#!/usr/bin/env bash
# Every GPU measurement of a session in one device call on a 2-GPU H200 host (kind
# nvidia-h200-x2, `.whl` carried: flashinfer + the server's wheels), in three timed phases so the
# call ends inside its 10 minutes; all logs come back as $OUT/results.tgz.
#   phase 1  GPU 1: attention conformance on cuda (TRITON, FLASHINFER, FLEX_ATTENTION)
#            GPU 0: bench throughput, qwen3-0.6b TRITON (+ HF baseline), llama-3.2-1b TRITON
#   phase 2  GPU 1: engine vs HF greedy parity (scripts/gpu_parity.py)
#            GPU 0: bench throughput qwen3-0.6b FLASHINFER, bench latency, serve + bench serve
#   phase 3  both: tensor-parallel greedy parity, TP=1 vs TP=2 (scripts/tp_parity.py)
# Knobs: PHASES (default "1 2 3").
set -uo pipefail

R=/tmp/results
mkdir -p "$R"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
STAGES=none OUT=$R bash scripts/gpu_check.sh >"$R/env.txt" 2>&1
export PYTHONPATH="/tmp/site:src:."
phases=" ${PHASES:-1 2 3} "

on() {  # on GPU SECONDS NAME COMMAND...: run on one GPU, log to $R/NAME.log
    local gpu=$1 limit=$2 name=$3 start=$SECONDS
    shift 3
    CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" "$@" >"$R/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - start)) s" | tee -a "$R/summary.txt"
}

throughput() {  # throughput NAME SECONDS ARGS...
    local name=$1 limit=$2
    shift 2
    on 0 "$limit" "$name" python3 -m attnserve.cli bench throughput --load-format dummy \
        --num-prompts 256 --min-len 100 --max-len 1024 --json "$R/$name.json" "$@"
}

serve_bench() {
    CUDA_VISIBLE_DEVICES=0 timeout 70 python3 -m attnserve.cli serve qwen3-0.6b \
        --load-format dummy --device cuda --port 8011 >"$R/server.log" 2>&1 &
    local server=$!
    for _ in $(seq 35); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" \
            2>/dev/null && break
        sleep 1
    done
    on 0 35 serve python3 -m attnserve.cli bench serve --base-url http://127.0.0.1:8011 \
        --num-prompts 200 --input-len 512 --output-len 128 --result-json "$R/serve.json"
    kill "$server" 2>/dev/null
}

if [[ $phases == *" 1 "* ]]; then
    on 1 170 conformance python3 -m pytest -o addopts= -v -p no:cacheprovider -p no:benchmark \
        -n 8 tests/attention/test_conformance.py -k "cuda and (FLASHINFER or FLEX or TRITON)" &
    # the fused layer kernels on cuda first; if they fail, the rest runs with plain torch ops
    on 0 35 fused_ops python3 -m pytest -o addopts= -q -p no:cacheprovider tests/model/test_fused_ops.py
    grep -q "^fused_ops: rc=0 " "$R/summary.txt" || export ATTNSERVE_FUSED_OPS=0
    throughput qwen3_triton 110 --model qwen3-0.6b --attention-backend TRITON \
        --hf-baseline --hf-num-prompts 16 --profile-steps 4
    throughput llama1b_triton 55 --model llama-3.2-1b --attention-backend TRITON \
        --profile-steps 0
    wait
    tar czf "$OUT/results.tgz" -C "$R" .  # each phase's logs come back even if a later one hangs
fi
if [[ $phases == *" 2 "* ]]; then
    on 1 150 parity python3 scripts/gpu_parity.py --models qwen3-0.6b \
        --backends TRITON,FLASHINFER --dtypes float32,bfloat16 --eager 0,1 --tokens 32 \
        --json "$R/parity.json" &
    throughput qwen3_flashinfer 90 --model qwen3-0.6b --attention-backend FLASHINFER \
        --profile-steps 0
    on 0 30 latency python3 -m attnserve.cli bench latency --model qwen3-0.6b \
        --load-format dummy --json "$R/latency.json"
    serve_bench
    wait
    tar czf "$OUT/results.tgz" -C "$R" .
fi
if [[ $phases == *" 3 "* ]]; then
    for tp in 1 2; do
        on 0,1 50 "tp_parity$tp" python3 scripts/tp_parity.py --model llama-3-8b \
            --tensor-parallel-size "$tp" --out "$R/tp_parity$tp.json"
    done
    python3 scripts/tp_parity.py --compare "$R/tp_parity1.json" "$R/tp_parity2.json" \
        >"$R/tp_parity.log" 2>&1
fi
tar czf "$OUT/results.tgz" -C "$R" .
cat "$R/summary.txt"
