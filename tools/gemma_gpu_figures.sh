#!/usr/bin/env bash
# Gemma 2 and Gemma 3 speed figures on one GPU (meant for one H200), run from the repository root:
#
#   bash tools/gemma_gpu_figures.sh
#
# For each preset in PRESETS (default: gemma-2-9b gemma-3-12b, real shapes, dummy weights, bf16,
# each preset's own max_model_len, the default attention backend), in a fresh process each:
#   throughput  the standard offline workload: `attnserve bench throughput --model PRESET
#               --load-format dummy --num-prompts 256 --min-len 100 --max-len 1024` (256
#               requests, 100..1024 random tokens in and out), with --profile-steps 0: no
#               step-time breakdown, which would rebuild the engine eagerly (~30 s more a preset)
#   latency     `attnserve bench latency --model PRESET --load-format dummy --batch-size B
#               --input-len 128 --output-len 128 --num-iters 3` for B = 1 and B = 8 (one warm-up
#               batch, then 3 timed ones: prefill, time per output token, end to end, median)
# Every run prints its result lines (`key  value`) and writes $OUT/gemma_<preset>_<run>.json;
# a summary of the headline figures comes last. The exit status is non-zero if a run failed or
# hit its time limit.
#
# Time: 254 s on an H200 (2026-12-02), engine start-ups included: the throughput runs 61 s
# (gemma-2-9b) and 76 s (gemma-3-12b), the latency runs 24-34 s each. Each run is capped
# (THROUGHPUT_TIMEOUT 120 s, LATENCY_TIMEOUT 60 s: 8 minutes at worst). Knobs (environment), e.g.
# for a smoke test on the CPU: PRESETS, NUM_PROMPTS, MIN_LEN, MAX_LEN, INPUT_LEN, OUTPUT_LEN,
# NUM_ITERS, BATCH_SIZES (default "1 8"), EXTRA_ARGS (added to every command, e.g. "--device
# cpu"), PYTHON (default python3).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
export OUT="${OUT:-/tmp/gemma_gpu_figures}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}
read -ra presets <<<"${PRESETS:-gemma-2-9b gemma-3-12b}"
read -ra batch_sizes <<<"${BATCH_SIZES:-1 8}"
read -ra extra <<<"${EXTRA_ARGS:-}"
status=0
runs=()

bench() {  # bench NAME SECONDS ARGS...: one `attnserve bench` run, its result lines shown
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name: attnserve bench $*"
    timeout "$limit" "$python" -m attnserve.cli bench "$@" "${extra[@]}" --json "$OUT/$name.json"
    rc=$?
    echo "-- $name: rc=$rc in $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] && runs+=("$OUT/$name.json") || status=1
}

for preset in "${presets[@]}"; do
    common=(--model "$preset" --load-format dummy)
    bench "gemma_${preset}_throughput" "${THROUGHPUT_TIMEOUT:-120}" throughput "${common[@]}" \
        --num-prompts "${NUM_PROMPTS:-256}" --min-len "${MIN_LEN:-100}" \
        --max-len "${MAX_LEN:-1024}" --profile-steps 0
    for batch in "${batch_sizes[@]}"; do
        bench "gemma_${preset}_latency_b$batch" "${LATENCY_TIMEOUT:-60}" latency "${common[@]}" \
            --batch-size "$batch" --input-len "${INPUT_LEN:-128}" \
            --output-len "${OUTPUT_LEN:-128}" --num-iters "${NUM_ITERS:-3}"
    done
done

echo "== summary ($(date -u +%FT%TZ))"
[ ${#runs[@]} -eq 0 ] || "$python" - "${runs[@]}" <<'EOF'
import json, sys

for path in sys.argv[1:]:
    r = json.load(open(path))
    head = f"{r['model']} {r['device']}"
    if "output_tokens_per_s" in r:
        print(f"{head} throughput: {r['output_tokens_per_s']:,.0f} output tok/s "
              f"({r['requests']} requests, {r['seconds']:.1f} s; "
              f"{r['fraction_of_bound']:.0%} of its bound {r['bound_tokens_per_s']:,.0f})")
    else:
        tpot = f", TPOT {r['median_tpot_ms']:.2f} ms" if "median_tpot_ms" in r else ""
        print(f"{head} latency batch {r['batch_size']} ({r['input_len']} in, "
              f"{r['output_len']} out, {r['backend']}): end to end "
              f"{r['median_e2e_latency_ms']:.1f} ms, prefill {r['median_prefill_ms']:.1f} ms{tpot}"
              " (medians)")
EOF
exit "$status"
