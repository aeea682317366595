#!/usr/bin/env bash
# Side-by-side runs on the GPU machine, in steps that fit the calls of one device session (the
# vLLM kit, ../shared/vllm-side-by-side, packed into .sbs/ by its pack.sh, is carried in three
# parts and staged by the first three calls):
#
#   bash tools/sbs/chain.sh STEP [STEP ...]
#
#   stage          copy the .sbs/v* part carried this call (device.sh stage); `install` after
#                  the third part
#   workloads      tools/sbs/workloads.py for every preset used below, into /tmp/wl
#   a-dense        attnserve: Qwen3-0.6B (standard + latency; fp8 KV), Llama-3-8B (standard +
#                  latency; fp8 weights)
#   a-kinds        attnserve: Qwen3-0.6B on the other workload kinds (chat, long, prefix, short)
#   a-fp8kv        the fp8-KV checks: TRITON's fp8 conformance and calibration tests on cuda,
#                  `bench throughput` under KV pressure (a tenth of what the batch needs) with
#                  either cache, `bench kv-quality`
#   a-moe          attnserve: Qwen3-30B-A3B and Mixtral-8x7B (standard + latency), Llama-3-70B
#                  in fp8 (latency)
#   v-PRESET[-VARIANT]  vLLM 0.26 on one configuration of the above (v-qwen3-30b-a3b,
#                  v-mixtral-8x7b, v-llama-3-8b-fp8, v-qwen3-0.6b-fp8kv, v-qwen3-0.6b-kinds,
#                  v-qwen3-0.6b-pressure, v-llama-3-8b)
#   moe-kernel     `attnserve bench moe` with vLLM's fused-MoE kernel beside ours
#
# Each run appends its JSON line to $OUT/sbs/results.jsonl and logs to $OUT/sbs/NAME.log.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
R=${OUT:-/tmp}/sbs
mkdir -p "$R" /tmp/wl
A_PATH="$PWD/src"
V_PATH="/tmp/site_v:/tmp/site_common"
QWEN_PRESSURE="--max-model-len 4096 --kv-cache-memory-bytes 3200000000"  # a tenth of what 256 need

drive() {  # drive LIMIT NAME ENGINE PRESET [ARGS...]
    local limit=$1 name=$2 engine=$3 s=$SECONDS path=$A_PATH
    shift 3
    [ "$engine" = vllm ] && path=$V_PATH
    timeout "$limit" env PYTHONPATH="$path" python3 tools/sbs/drive.py "$engine" "$@" \
        /tmp/wl --out "$R/$name.json" >"$R/$name.log" 2>&1
    echo "== $name rc=$? $((SECONDS - s)) s"
    grep -E "^\[(attnserve|vllm)\]" "$R/$name.log"
    [ -f "$R/$name.json" ] && cat "$R/$name.json" >>"$R/results.jsonl" ||
        grep -vE "Warning|warn\(" "$R/$name.log" | tail -4 | cut -c1-300
}

for step in "$@"; do
    case $step in
    stage) bash .sbs/kit/device.sh stage ;;
    install) bash .sbs/kit/device.sh install ;;
    workloads)
        for m in qwen3-0.6b llama-3-8b qwen3-30b-a3b mixtral-8x7b; do
            PYTHONPATH=$A_PATH python3 tools/sbs/workloads.py $m /tmp/wl 2>&1 | grep standard
        done ;;
    a-dense)
        drive 90 a-qwen3-0.6b attnserve qwen3-0.6b --latency
        drive 60 a-qwen3-0.6b-fp8kv attnserve qwen3-0.6b --kv-cache-dtype fp8
        drive 90 a-llama-3-8b attnserve llama-3-8b --latency
        drive 80 a-llama-3-8b-fp8 attnserve llama-3-8b --quantization fp8 ;;
    a-kinds) drive 150 a-qwen3-0.6b-kinds attnserve qwen3-0.6b --kinds chat,long,prefix,short ;;
    a-fp8kv)
        s=$SECONDS
        timeout 70 env PYTHONPATH=$A_PATH python3 -m pytest -o addopts= -q -p no:cacheprovider \
            -n 8 -rfE -k 'fp8 or kv_calibration' tests/attention/test_conformance.py \
            tests/worker/test_kv_calibration.py 2>&1 | tail -4
        echo "== fp8 tests $((SECONDS - s)) s"
        for d in auto fp8; do
            s=$SECONDS
            timeout 60 env PYTHONPATH=$A_PATH python3 -m attnserve.cli bench throughput \
                --model qwen3-0.6b --load-format dummy --num-prompts 256 --min-len 100 \
                --max-len 1024 $QWEN_PRESSURE --kv-cache-dtype $d --profile-steps 0 \
                --json "$R/pressure-$d.json" >"$R/pressure-$d.log" 2>&1
            echo "== pressure $d rc=$? $((SECONDS - s)) s"; tail -12 "$R/pressure-$d.log" | cut -c1-200
        done
        s=$SECONDS
        timeout 60 env PYTHONPATH=$A_PATH python3 -m attnserve.cli bench kv-quality \
            --model qwen3-0.6b --load-format dummy --kv-cache-dtype fp8 >"$R/kv-quality.log" 2>&1
        echo "== kv-quality rc=$? $((SECONDS - s)) s"; tail -14 "$R/kv-quality.log" | cut -c1-200 ;;
    a-moe)
        drive 150 a-qwen3-30b-a3b attnserve qwen3-30b-a3b --latency
        drive 180 a-mixtral-8x7b attnserve mixtral-8x7b --latency
        s=$SECONDS
        timeout 150 env PYTHONPATH=$A_PATH python3 -m attnserve.cli bench latency --model llama-3-70b \
            --load-format dummy --quantization fp8 --max-model-len 1024 --batch-size 8 \
            --input-len 128 --output-len 32 --num-iters 3 >"$R/a-llama-3-70b-fp8.log" 2>&1
        echo "== a-llama-3-70b-fp8 rc=$? $((SECONDS - s)) s"
        grep -vE "Warning|warn\(" "$R/a-llama-3-70b-fp8.log" | tail -8 | cut -c1-300 ;;
    v-qwen3-30b-a3b) drive 280 v-qwen3-30b-a3b vllm qwen3-30b-a3b --latency ;;
    v-mixtral-8x7b) drive 300 v-mixtral-8x7b vllm mixtral-8x7b --latency ;;
    v-llama-3-8b) drive 240 v-llama-3-8b vllm llama-3-8b --latency ;;
    v-llama-3-8b-fp8) drive 240 v-llama-3-8b-fp8 vllm llama-3-8b --quantization fp8 ;;
    v-qwen3-0.6b-fp8kv) drive 200 v-qwen3-0.6b-fp8kv vllm qwen3-0.6b --kv-cache-dtype fp8 ;;
    v-qwen3-0.6b-kinds)
        drive 260 v-qwen3-0.6b-kinds vllm qwen3-0.6b --kinds standard,chat,long,prefix,short --latency ;;
    v-qwen3-0.6b-pressure) drive 200 v-qwen3-0.6b-pressure vllm qwen3-0.6b $QWEN_PRESSURE ;;
    moe-kernel)
        s=$SECONDS
        timeout 150 env PYTHONPATH="$A_PATH:$V_PATH" python3 -m attnserve.cli bench moe \
            --json "$R/moe-kernel.json" >"$R/moe-kernel.log" 2>&1
        echo "== moe-kernel rc=$? $((SECONDS - s)) s"
        grep -vE "Warning|warn\(" "$R/moe-kernel.log" | tail -45 | cut -c1-160 ;;
    *) echo "unknown step $step" ;;
    esac
done
