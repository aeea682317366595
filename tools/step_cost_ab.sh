#!/usr/bin/env bash
# Host time of engine steps, before/after, in one call: tools/step_profile.py run alternately on
# an older tree's src (the first argument; e.g. `git archive OLD src | tar -x -C /tmp/old`) and
# on this tree's, REPEATS times each (default 2), for four cases:
#   cuda decode   Qwen3-0.6B's shape, 256 sequences, CUDA graphs on (`--steps 30`)
#   cuda prompt   Qwen3-0.6B's shape, 8,192 prompt tokens a step in 16 prompts (`--steps 8`)
#   cpu decode    llama-tiny on the CPU, 256 sequences, forward and logits stubbed (host only)
#   cpu prompt    llama-tiny on the CPU, 8,192 prompt tokens a step, stubbed
# Cases without CUDA are skipped where there is no GPU. Prints one line per run ("host (median)"
# of the tool, ms) and a table of the median run per case and tree; CASES selects cases by name
# (comma-separated), PYTHON the interpreter (default python3).
#
#   bash tools/step_cost_ab.sh /tmp/old/src [REPEATS]
set -uo pipefail
old=${1:?usage: step_cost_ab.sh OLD_SRC [REPEATS]} repeats=${2:-2} python=${PYTHON:-python3}
new=$(cd "$(dirname "$0")/.." && pwd)/src
declare -A args=(
    ["cuda decode"]="--model qwen3-0.6b --device cuda --steps 30"
    ["cuda prompt"]="--model qwen3-0.6b --device cuda --kind prompt --steps 8"
    ["cpu decode"]="--stub-model --steps 30"
    ["cpu prompt"]="--stub-model --kind prompt --steps 30"
)
cases=${CASES:-cuda decode,cuda prompt,cpu decode,cpu prompt}
has_cuda=$("$python" -c "import torch; print(int(torch.cuda.is_available()))")
results=$(mktemp)
IFS=, read -ra selected <<<"$cases"
for case in "${selected[@]}"; do
    [[ $case == cuda* && $has_cuda != 1 ]] && { echo "$case: skipped (no GPU)"; continue; }
    for ((i = 0; i < repeats; i++)); do
        for tree in before after; do
            src=$new
            [ "$tree" = before ] && src=$old
            # shellcheck disable=SC2086  # the case's arguments are a list of words
            host=$(PYTHONPATH=$src timeout 300 "$python" "$new/../tools/step_profile.py" \
                ${args[$case]} 2>&1 | awk '/host \(median\)/ {print $3}')
            echo "$case $tree ${host:-failed}" | tee -a "$results"
        done
    done
done
echo
python3 - "$results" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    *case, tree, value = line.split()
    if value != "failed":
        runs.setdefault(" ".join(case), {}).setdefault(tree, []).append(float(value))
print(f"{'case':12s} {'before':>8s} {'after':>8s} {'after/before':>12s}  (ms, median run)")
for case, trees in runs.items():
    before, after = (statistics.median(trees.get(t, [float("nan")])) for t in ("before", "after"))
    print(f"{case:12s} {before:8.2f} {after:8.2f} {after / before:12.2f}")
PY
