#!/usr/bin/env bash
# Every GPU measurement of a session in device calls on a 2-GPU H200 host (kind nvidia-h200-x2,
# `.whl` carried: flashinfer + the server's wheels; `.fi_aot` carried when an earlier call
# compiled FlashInfer modules), in timed phases so a call ends inside its 10 minutes. All logs
# come back as $OUT/results.tgz, the FlashInfer modules compiled so far as $OUT/fi_aot.tgz.part-*
# (copy them into .fi_aot/ for the next call).
#   phase 1  GPU 1: attention conformance on cuda (TRITON, FLASHINFER, FLEX_ATTENTION)
#            GPU 0: a small FLASHINFER throughput run with CUDA_LAUNCH_BLOCKING=1 (its trace),
#                   bench throughput qwen3-0.6b TRITON (+ HF baseline), llama-3.2-1b TRITON,
#                   bench kernels
#   phase 2  GPU 1: conformance cases to re-run, with tracebacks (RERUN_SELECT), then engine vs
#                   HF greedy parity (scripts/gpu_parity.py)
#            GPU 0: FLASHINFER trace run, bench throughput qwen3-0.6b FLASHINFER and TRITON
#                   (+ breakdown, + HF baseline)
#   phase 3  GPU 1: FLEX_ATTENTION conformance; GPU 0: FlashInfer's head-64 modules compiled;
#            then, one at a time on GPU 0: bench throughput of both models with TRITON and
#            FLASHINFER (+ breakdown), Llama-3.2-1B's HF baseline, bench kernels
#   phase 4  both: tensor-parallel greedy parity, TP=1 vs TP=2 (scripts/tp_parity.py)
#   phase 5  GPU 1: the cuda suite of TRITON and FLEX_ATTENTION (+ FLASHINFER's padding test),
#                   TRITON's own kernel tests
#            GPU 0: TRITON prefill sweep; then alone: bench kernels, a first and a second
#                   TRITON throughput run (own Triton cache), TRITON parity (PARITY=0: none)
# Knobs: PHASES (default "1 2 3 4"; phase 5 on request).
set -uo pipefail

R=/tmp/results
mkdir -p "$R"
export NCCL_NVLS_ENABLE=0
STAGES=none OUT=$R bash scripts/gpu_check.sh >"$R/env.txt" 2>&1
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
phases=" ${PHASES:-1 2 3 4} "

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

conformance() {  # conformance NAME SECONDS PYTEST-ARGS...: the cuda suite on GPU 1
    local name=$1 limit=$2
    shift 2
    on 1 "$limit" "$name" python3 -m pytest -o addopts= -v -p no:cacheprovider -p no:benchmark \
        --tb=short "$@" tests/attention/test_conformance.py
}

pack() {  # each phase's logs come back even if a later one hangs
    tar czf "$OUT/results.tgz" -C "$R" .
    save_flashinfer_modules "$OUT/fi_aot.tgz"  # FlashInfer modules for the next call
}

if [[ $phases == *" 1 "* ]]; then
    conformance conformance 470 -n 12 --durations=20 -rfE \
        -k "cuda and (FLASHINFER or FLEX or TRITON)" &
    CUDA_LAUNCH_BLOCKING=1 on 0 150 flashinfer_trace python3 -m attnserve.cli bench throughput \
        --load-format dummy --model qwen3-0.6b --attention-backend FLASHINFER \
        --num-prompts 32 --min-len 100 --max-len 300
    throughput qwen3_triton 170 --model qwen3-0.6b --attention-backend TRITON \
        --hf-baseline --hf-num-prompts 16 --profile-steps 4
    throughput llama1b_triton 60 --model llama-3.2-1b --attention-backend TRITON \
        --profile-steps 0
    on 0 90 kernels python3 -m attnserve.cli bench kernels --backends TRITON \
        --json "$R/kernels.json"
    wait
    pack
fi
if [[ $phases == *" 2 "* ]]; then
    {
        conformance conformance_rerun 200 \
            -k "${RERUN_SELECT:-cuda and (FLEX or FLASHINFER) and (11 or 29 or 41 or 21)}"
        on 1 240 parity python3 scripts/gpu_parity.py --models qwen3-0.6b \
            --backends TRITON,FLASHINFER,FLEX_ATTENTION --dtypes float32,bfloat16 --eager 0,1 \
            --tokens 32 --json "$R/parity.json"
    } &
    CUDA_LAUNCH_BLOCKING=1 on 0 200 flashinfer_trace python3 -m attnserve.cli bench throughput \
        --load-format dummy --model qwen3-0.6b --attention-backend FLASHINFER \
        --num-prompts 16 --min-len 100 --max-len 200
    throughput qwen3_flashinfer 100 --model qwen3-0.6b --attention-backend FLASHINFER \
        --profile-steps 4
    throughput qwen3_triton 180 --model qwen3-0.6b --attention-backend TRITON \
        --hf-baseline --hf-num-prompts 16 --profile-steps 4
    wait
    pack
fi
if [[ $phases == *" 3 "* ]]; then
    conformance conformance_flex 240 -n 4 -k "cuda and FLEX" &
    throughput llama1b_flashinfer_compile 200 --model llama-3.2-1b \
        --attention-backend FLASHINFER --num-prompts 16
    wait
    # one run at a time from here: the engine is host-bound, so nothing else may load the CPUs
    for model in qwen3-0.6b llama-3.2-1b; do
        for backend in TRITON FLASHINFER; do
            throughput "${model}_${backend}" 70 --model "$model" --attention-backend "$backend" \
                --profile-steps 4
        done
    done
    pack
    throughput llama1b_hf 110 --model llama-3.2-1b --attention-backend TRITON --hf-baseline \
        --hf-num-prompts 16
    on 0 60 kernels python3 -m attnserve.cli bench kernels --backends TRITON,FLASHINFER \
        --json "$R/kernels.json"
    pack
fi
if [[ $phases == *" 4 "* ]]; then
    for tp in 1 2; do
        on 0,1 50 "tp_parity$tp" python3 scripts/tp_parity.py --model llama-3-8b \
            --tensor-parallel-size "$tp" --out "$R/tp_parity$tp.json"
    done
    python3 scripts/tp_parity.py --compare "$R/tp_parity1.json" "$R/tp_parity2.json" \
        >"$R/tp_parity.log" 2>&1
fi
if [[ $phases == *" 5 "* ]]; then
    # phase 5 checks the prefill kernel that reads the new keys from the step (TMA on Hopper) and
    # FLEX_ATTENTION on torch's standard kernel. The engine is host-bound: the kernel bench, the
    # throughput runs and parity each run alone. The throughput runs get their own Triton cache,
    # so the first compiles everything; the kernels it compiled while timed are listed.
    {
        conformance conformance 300 -n 8 -rfE \
            -k "cuda and (TRITON or FLEX or (FLASHINFER and padding))"
        on 1 120 triton_ops python3 -m pytest -o addopts= -q -p no:cacheprovider -rfE \
            tests/attention/test_triton_prefill.py tests/attention/test_triton_ops.py
    } &
    on 0 200 prefill_sweep python3 scripts/sweep_triton_prefill.py --budget-s 150 \
        --json "$R/prefill_sweep.json"
    wait
    on 0 90 kernels python3 -m attnserve.cli bench kernels --backends TRITON,FLASHINFER \
        --json "$R/kernels.json"
    pack
    export TRITON_CACHE_DIR=/tmp/engine_triton_cache
    for run in first second; do
        throughput "qwen3_triton_$run" 70 --model qwen3-0.6b --attention-backend TRITON
    done
    find "$TRITON_CACHE_DIR" -name "*.json" ! -name "__grp__*" -printf "%TT %f\n" | sort \
        >"$R/engine_kernels_compiled.txt"
    unset TRITON_CACHE_DIR
    grep -h "profile run\|KV cache:\|timing\|tok/s" "$R"/qwen3_triton_*.log
    if [[ ${PARITY:-1} == 1 ]]; then
        on 1 200 parity python3 scripts/gpu_parity.py --models qwen3-0.6b --backends TRITON \
            --dtypes bfloat16,float32 --eager 0 --tokens 32 --json "$R/parity.json"
    fi
fi
pack
cat "$R/summary.txt"
