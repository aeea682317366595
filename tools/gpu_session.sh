#!/usr/bin/env bash
# Every GPU check of attnserve in one call, run on the GPU machine from the repository root:
#
#   bash tools/gpu_session.sh [PHASE ...]     (default: every phase, in this order)
#
#   env          the card, driver and versions, and which attention backends can run (always
#                runs first; the carried wheels are installed before it)
#   conformance  the attention conformance suite and the Triton kernel tests (tests/attention)
#                on cuda, every backend; FLASHINFER and FLEX_ATTENTION on a subset by default
#   gpu          the CUDA-marked pytest tests (tests/gpu: engine vs HF parity per backend, fp32
#                and bf16, CUDA graphs on and off; TP=2 parity where 2 GPUs are visible)
#   kernels      `attnserve bench kernels` (every backend that fits)
#   throughput   `attnserve bench throughput`, the standard offline workload on Qwen3-0.6B's
#                shape (dummy weights, 256 requests, 100..1024 tokens in and out)
#   kinds        the workload kinds whose steps carry prompts beside decodes, through the step
#                timeline (tools/step_timeline.py, one run each, fresh Triton cache): Qwen3-0.6B's
#                chat-like mix and Llama-3-8B's long prompts. Run it before and after every
#                kernel or scheduler change; JSON: kinds_chat, kinds_long (KINDS_TIMEOUT 200 s)
#   fp8kv        the fp8 KV cache against the bf16 one (issue 22): the fp8 GPU tests (TRITON's fp8
#                conformance cases, the Triton kernel tests, scale calibration, kv-quality), bench
#                kernels --backends TRITON for both caches, the standard throughput workload for
#                both, the same under KV pressure (FP8KV_PRESSURE_BYTES, default 3.3e9: a tenth of
#                the ~33 GB the workload's bf16 K/V take), and bench kv-quality on Qwen3-0.6B;
#                JSON: throughput_{auto,fp8}, pressure_{auto,fp8}, kv_quality (steps limited to
#                545 s in all, FP8KV_TIMEOUT 540 s: run it alone, `bash tools/gpu_session.sh fp8kv`)
#   backends     `attnserve bench backends` (bench/backends.py): every backend that runs here on
#                the standard, prefix and long kinds, output tok/s and attention share side by
#                side (BACKENDS_ARGS, e.g. "--backends TRITON,FLASH_ATTN --workloads prefix";
#                BACKENDS_TIMEOUT, default 420 s: run it alone)
#   lora         the LoRA products' cost a decode token (tools/lora_cost.py --sweep) and batch-1
#                latency on Llama-3-8B's shape without and with one rank-16 adapter (issue 52's
#                target: <= 1.1x); LORA_TIMEOUT (default 300 s)
#   serve        `attnserve bench serve --launch` on Qwen3-0.6B's shape: a burst of 400 streamed
#                requests (512 in, 128 out) against the server (engine core in its own process),
#                then LLM.generate of the same requests, and their ratio (needs the fastapi,
#                uvicorn and pydantic wheels in .whl/)
#
# Wheels the machine lacks (flashinfer-python 0.6.1, flash-attn-4 and their needs) are carried in
# .whl/ and installed into /tmp/site (tools/README.md says how). Each phase writes
# $OUT/PHASE.log (kernels and throughput also PHASE.json); $OUT/summary.txt lists each phase's
# exit status and seconds: 8 files at most.
# The exit status is non-zero if a phase failed or ran out of time.
#
# Knobs (environment). The default phases' limits add up to 580 s (a full run fits one call):
#   CONFORMANCE_SELECT   extended regex over collected test ids; only matching tests run.
#                        Default: every cuda test of TORCH_SDPA, TRITON, FLASH_ATTN and the
#                        ONE_FILE example, the Triton kernel tests, FLASHINFER's bf16 head-128
#                        cases without window or soft-cap, three FLEX_ATTENTION cases.
#                        FLASHINFER's modules for those cases (prefill, decode, tensor-core
#                        decode) took over 180 s to build on an H100 (2026-12-06): on a fresh
#                        machine build them in a call of their own (CONFORMANCE_SELECT=
#                        FLASHINFER-cuda CONFORMANCE_TIMEOUT=500), run the rest in the next.
#                        '-cuda' selects every cuda test: the full FLASHINFER grid needs ~20
#                        minutes of compilation, so split it by backend or case over calls.
#   CONFORMANCE_WORKERS  pytest-xdist workers (default 8); CONFORMANCE_TIMEOUT (default 170 s)
#   GPU_TESTS_TIMEOUT    (default 180 s)
#   KERNELS_ARGS         extra arguments of bench kernels (e.g. "--backends TRITON --sweep
#                        decode,prefill"); KERNELS_TIMEOUT (default 90 s)
#   THROUGHPUT_ARGS      extra arguments of bench throughput (e.g. "--attention-backend
#                        FLASHINFER --hf-baseline --hf-num-prompts 16"); THROUGHPUT_TIMEOUT
#                        (default 80 s)
set -uo pipefail

export OUT="${OUT:-/tmp/gpu_session_out}"  # the fp8kv phase writes under it
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # never NVLink multicast
export ATTNSERVE_CACHE_DIR=/tmp/attnserve-cache  # the kernel libraries' JIT caches too
CUTLASS_PARTS=/tmp/cutlass-cu13-parts
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    # cutlass-dsl's CUDA 13 libraries (flash-attn-4's compiler; 92 MB as a wheel) come in two
    # parts, .fa4a/ and .fa4b/, carried by two calls on the same warm machine. A carried folder
    # does not stay for the next call, so each part is kept in $CUTLASS_PARTS (outside the
    # tree) and the two are joined once both are there (unpacked by Python's tarfile: the image
    # may have no xz); pip --upgrade replaces the package's folder, so they are unpacked again
    # after every install
    for part in .fa4a/cu13part.aa .fa4b/cu13part.ab; do
        [ -f "$part" ] && mkdir -p "$CUTLASS_PARTS" && cp "$part" "$CUTLASS_PARTS/"
    done
    if [ -f "$CUTLASS_PARTS/cu13part.aa" ] && [ -f "$CUTLASS_PARTS/cu13part.ab" ]; then
        cat "$CUTLASS_PARTS/cu13part.aa" "$CUTLASS_PARTS/cu13part.ab" | python3 -c 'import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall("/tmp/site")' || exit 1
        echo "cutlass-dsl cu13 libraries unpacked"
    elif compgen -G ".whl/nvidia_cutlass_dsl*.whl" >/dev/null; then
        echo "warning: cutlass-dsl without its cu13 libraries (.fa4a/ and .fa4b/, one call" \
            "each): flashinfer and flash-attn-4 fail to import" >&2
    fi
    # the .pth that cutlass-dsl installs is not read from a --target folder
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:src
else
    export PYTHONPATH=src
fi

status=0
phase() {  # phase NAME SECONDS COMMAND...: log to $OUT/NAME.log, note the outcome, show its end
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name"
    timeout "$limit" bash -c '"$@"' "$name" "$@" >"$OUT/$name.log" 2>&1  # functions too
    rc=$?
    tail -n 40 "$OUT/$name.log" | cut -c1-220
    echo "$name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || status=1
}

env_report() {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
    python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
    python3 -c "import flash_attn.cute as fa; print('flash-attn-4', fa.__version__)"
    python3 -m attnserve.cli backends --model qwen3-0.6b --dtype bfloat16 --device cuda
}

conformance() {
    local select tests workers=()
    select='(TORCH_SDPA|TRITON|ONE_FILE|FLASH_ATTN)-cuda|test_triton_(ops|prefill)\.py'
    select+='|FLASHINFER-cuda(\]|-block|-Case\(.*head_size=128, block_size=[0-9]+, '
    select+='dtype=torch\.bfloat16, sliding_window=None, alibi=False, soft_cap=None)'
    select+='|FLEX_ATTENTION-cuda(\]|-block|-Case\(.*seed=(9|25|34)\))'
    select="${CONFORMANCE_SELECT:-$select}"
    mapfile -t tests < <(python3 -m pytest --collect-only -q -o addopts= -p no:cacheprovider \
        tests/attention 2>/dev/null | grep -E '::' | grep -E -- "$select")
    echo "${#tests[@]} tests selected by: $select"
    [ "${#tests[@]}" -gt 0 ] || return 1
    [ "${CONFORMANCE_WORKERS:-8}" -gt 0 ] && workers=(-n "${CONFORMANCE_WORKERS:-8}")
    python3 -m pytest -o addopts= -v -p no:cacheprovider -p no:benchmark -rfE --durations=10 \
        "${workers[@]}" "${tests[@]}"
}

fp8kv() {  # each step under its own limit; the phase fails if any step does
    local rc=0 dtype workload=(--model qwen3-0.6b --load-format dummy --num-prompts 256
        --min-len 100 --max-len 1024)
    local pressure=${FP8KV_PRESSURE_BYTES:-3300000000}
    run_step() {  # run_step SECONDS COMMAND...
        local limit=$1 start=$SECONDS
        shift
        echo "-- $*"
        timeout "$limit" "$@" || { echo "-- failed: rc=$?"; rc=1; }
        echo "-- $((SECONDS - start)) s"
    }
    run_step 90 python3 -m pytest -o addopts= -q -p no:cacheprovider -p no:benchmark -rfE \
        -n "${CONFORMANCE_WORKERS:-8}" -k 'fp8 or test_triton_ops or kv_calibration' \
        tests/attention/test_conformance.py tests/attention/test_triton_ops.py \
        tests/worker/test_kv_calibration.py tests/test_bench_kv_quality.py
    for dtype in auto fp8; do
        run_step 45 python3 -m attnserve.cli bench kernels --backends TRITON --kv-cache-dtype "$dtype"
    done
    for dtype in auto fp8; do
        run_step 70 python3 -m attnserve.cli bench throughput "${workload[@]}" \
            --kv-cache-dtype "$dtype" --json "$OUT/throughput_$dtype.json"
    done
    for dtype in auto fp8; do
        run_step 90 python3 -m attnserve.cli bench throughput "${workload[@]}" \
            --kv-cache-dtype "$dtype" --kv-cache-memory-bytes "$pressure" \
            --json "$OUT/pressure_$dtype.json"
    done
    run_step 45 python3 -m attnserve.cli bench kv-quality --model qwen3-0.6b --load-format dummy \
        --kv-cache-dtype fp8 --json "$OUT/kv_quality.json"
    return "$rc"
}

kinds() {  # each kind in a process of its own, its Triton cache empty (as on a fresh machine)
    local rc=0 preset kind
    for pair in qwen3-0.6b:chat llama-3-8b:long; do
        preset=${pair%%:*} kind=${pair##*:}
        echo "-- $preset $kind"
        TRITON_CACHE_DIR=$(mktemp -d) timeout 95 python3 tools/step_timeline.py "$preset" \
            --workload "$kind" --runs 1 --profile-prompt-steps 0 --json "$OUT/kinds_$kind.json" \
            || { echo "-- failed: rc=$?"; rc=1; }
    done
    return "$rc"
}

lora() {  # batch-1 latency without and with one adapter, same process kind and flags
    local latency=(python3 -m attnserve.cli bench latency --model llama-3-8b --load-format dummy
        --batch-size 1)  # docs/benchmarks.md's LoRA rows
    python3 tools/lora_cost.py --sweep || return 1
    "${latency[@]}" --json "$OUT/lora_base.json" || return 1
    "${latency[@]}" --enable-lora --num-loras 1 --lora-rank 16 --json "$OUT/lora_one.json"
}

export -f env_report conformance fp8kv kinds lora

phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(conformance gpu kernels throughput)
for name in "${phases[@]}"; do
    case $name in
        env | conformance | gpu | kernels | throughput | kinds | fp8kv | backends | lora | serve) ;;
        *) echo "unknown phase $name (env, conformance, gpu, kernels, throughput, kinds, fp8kv, backends, lora, serve)" >&2 && exit 2 ;;
    esac
done
: >"$OUT/summary.txt"
phase env 60 env_report  # a first flashinfer import took over 20 s
for name in "${phases[@]}"; do
    case $name in
        conformance) phase conformance "${CONFORMANCE_TIMEOUT:-170}" conformance ;;
        gpu)
            phase gpu "${GPU_TESTS_TIMEOUT:-180}" python3 -m pytest -o addopts= -v \
                -p no:cacheprovider -p no:benchmark -rfEs -m cuda tests/gpu
            ;;
        kernels)
            # shellcheck disable=SC2086  # KERNELS_ARGS is a list of words
            phase kernels "${KERNELS_TIMEOUT:-90}" python3 -m attnserve.cli bench kernels \
                --json "$OUT/kernels.json" ${KERNELS_ARGS:-}
            ;;
        throughput)
            # shellcheck disable=SC2086  # THROUGHPUT_ARGS is a list of words
            phase throughput "${THROUGHPUT_TIMEOUT:-80}" python3 -m attnserve.cli bench \
                throughput --model qwen3-0.6b --load-format dummy --num-prompts 256 \
                --min-len 100 --max-len 1024 --json "$OUT/throughput.json" ${THROUGHPUT_ARGS:-}
            ;;
        kinds) phase kinds "${KINDS_TIMEOUT:-200}" kinds ;;
        backends)
            # shellcheck disable=SC2086  # BACKENDS_ARGS is a list of words
            phase backends "${BACKENDS_TIMEOUT:-420}" python3 -m attnserve.cli bench backends \
                --json "$OUT/backends.json" ${BACKENDS_ARGS:-}
            ;;
        lora) phase lora "${LORA_TIMEOUT:-300}" lora ;;
        fp8kv) phase fp8kv "${FP8KV_TIMEOUT:-540}" fp8kv ;;
        serve)
            # shellcheck disable=SC2086  # SERVE_ARGS is a list of words
            phase serve "${SERVE_TIMEOUT:-150}" python3 -m attnserve.cli bench serve \
                --launch "qwen3-0.6b --load-format dummy --device cuda" --compare-generate \
                --num-prompts 400 --input-len 512 --output-len 128 --token-ids 3 30000 \
                --result-json "$OUT/serve.json" ${SERVE_ARGS:-}
            ;;
    esac
done
cat "$OUT/summary.txt"
exit "$status"
