#!/usr/bin/env bash
# The server before/after on the GPU machine, in one call: for each tree (an older src, then this
# one) `attnserve serve MODEL_DIR --load-format dummy --device cuda`, loaded by this tree's
# `attnserve bench serve` (which reads either server's latency breakdown where it has one): a
# short warm-up burst, then a burst of SERVE_PROMPTS (default 400) requests of 512 tokens in and
# 128 out, then the same requests as Poisson arrivals at each RATE (requests/s).
#
#   bash tools/serve_ab.sh OLD_SRC MODEL_DIR [RATE ...]      (default rates: 16)
#
# MODEL_DIR: a config.json at real shapes with a tokenizer beside it (the side-by-side kit's
# smol-llama-8b: Llama-3-8B's shape, SmolLM2's tokenizer). Wheels the machine lacks (fastapi,
# uvicorn, pydantic, httptools, ...) travel in .whl/ and are installed into /tmp/site first.
# DEVICE (default cuda) runs the servers elsewhere (cpu: a dry run of the script).
# Writes $OUT/serve-{old,new}-{burst,RATE}.json and the servers' logs; prints each report.
set -uo pipefail
old=${1:?usage: serve_ab.sh OLD_SRC MODEL_DIR [RATE ...]} model=${2:?MODEL_DIR}
shift 2
rates=("${@:-16}")
out=${OUT:-/tmp/serve_ab}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
new=$PWD/src
client() {  # client TAG RATE NUM: this tree's bench serve against the server on port 8400
    PYTHONPATH=/tmp/site:$new timeout 200 python3 -m attnserve.cli bench serve \
        --base-url http://127.0.0.1:8400 --num-prompts "$3" --input-len 512 --output-len 128 \
        --request-rate "$2" --result-json "$out/serve-$1.json" >"$out/client-$1.log" 2>&1
    echo "== $1 rc=$?"
    grep -E "throughput \(tok|Mean|P99 (TTFT|ITL)|front-end|stages|^[a-z]+:" "$out/client-$1.log"
}
for tree in old new; do
    src=$new
    [ "$tree" = old ] && src=$old
    start=$SECONDS
    PYTHONPATH=/tmp/site:$src python3 -m attnserve.cli serve "$model" --load-format dummy \
        --device "${DEVICE:-cuda}" --port 8400 --uvicorn-log-level warning >"$out/server-$tree.log" 2>&1 &
    pid=$!
    up=0
    for _ in $(seq 240); do
        kill -0 $pid 2>/dev/null || break
        if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8400/health', timeout=2)" 2>/dev/null; then
            up=1
            break
        fi
        sleep 1
    done
    echo "== $tree server up=$up in $((SECONDS - start)) s"
    if [ $up = 1 ]; then
        client "$tree-warm" inf 32 >/dev/null
        client "$tree-burst" inf "${SERVE_PROMPTS:-400}"
        for rate in "${rates[@]}"; do client "$tree-$rate" "$rate" "${SERVE_PROMPTS:-400}"; done
    else
        tail -20 "$out/server-$tree.log"
    fi
    kill $pid 2>/dev/null
    wait $pid 2>/dev/null
done
