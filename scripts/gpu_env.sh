#!/usr/bin/env bash
# Sourced by the GPU scripts on the device machine (repository root): installs the carried wheels
# (.whl/*.whl) into /tmp/site once, restores FlashInfer modules compiled by an earlier call
# (.fi_aot/fi_aot.tgz.part-*, carried) as its ahead-of-time modules so they are not rebuilt, and
# exports PYTHONPATH. `save_flashinfer_modules PREFIX` packs the modules compiled in this call
# (plus the restored ones; attention variants only if their name matches FLASHINFER_KEEP, by
# default bf16 without window or soft-cap) into PREFIX.part-* for the next call to carry back in
# .fi_aot/.
export PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
export FLASHINFER_KEEP="${FLASHINFER_KEEP:-dtype_q_bf16_*use_swa_False_use_logits_cap_False}"
if compgen -G ".whl/*.whl" >/dev/null; then
    if [ ! -d /tmp/site/flashinfer ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        if compgen -G ".fi_aot/fi_aot.tgz.part-*" >/dev/null; then
            mkdir -p /tmp/site/flashinfer/data/aot
            cat .fi_aot/fi_aot.tgz.part-* | tar xzf - -C /tmp/site/flashinfer/data/aot
        fi
    fi
    export PYTHONPATH="/tmp/site:src:."
else
    export PYTHONPATH="src:."
fi

save_flashinfer_modules() {  # save_flashinfer_modules PREFIX: PREFIX.part-aa, -ab, ... (15 MB each)
    local staging=/tmp/fi_modules so name
    mkdir -p "$staging"
    [ -d /tmp/site/flashinfer/data/aot ] && cp -r /tmp/site/flashinfer/data/aot/. "$staging/"
    for so in "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops/*/*.so; do
        [ -f "$so" ] || continue
        name=$(basename "$(dirname "$so")")
        case $name in  # what a call brings back must stay small: the engine models' variants
            batch_*) [[ $name == *$FLASHINFER_KEEP* ]] || continue ;;
        esac
        mkdir -p "$staging/$name"
        cp "$so" "$staging/$name/"
    done
    du -sh "$staging"/* 2>/dev/null
    tar czf - -C "$staging" . | split -b 15m - "$1.part-"
}
