#!/usr/bin/env bash
# Sourced by the GPU scripts on the device machine (repository root): installs the carried wheels
# (.whl/*.whl) into /tmp/site once, restores FlashInfer modules compiled by an earlier call
# (.fi_aot/fi_aot.tgz, carried) as its ahead-of-time modules so they are not rebuilt, and exports
# PYTHONPATH. `save_flashinfer_modules FILE` packs every module compiled in this call (plus the
# restored ones) into FILE for the next call to carry back as .fi_aot/fi_aot.tgz.
export PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
if compgen -G ".whl/*.whl" >/dev/null; then
    if [ ! -d /tmp/site/flashinfer ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        if [ -f .fi_aot/fi_aot.tgz ]; then
            mkdir -p /tmp/site/flashinfer/data/aot
            tar xzf .fi_aot/fi_aot.tgz -C /tmp/site/flashinfer/data/aot
        fi
    fi
    export PYTHONPATH="/tmp/site:src:."
else
    export PYTHONPATH="src:."
fi

save_flashinfer_modules() {  # save_flashinfer_modules FILE
    local staging=/tmp/fi_modules so
    mkdir -p "$staging"
    [ -d /tmp/site/flashinfer/data/aot ] && cp -r /tmp/site/flashinfer/data/aot/. "$staging/"
    for so in "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops/*/*.so; do
        [ -f "$so" ] || continue
        mkdir -p "$staging/$(basename "$(dirname "$so")")"
        cp "$so" "$staging/$(basename "$(dirname "$so")")/"
    done
    tar czf "$1" -C "$staging" .
}
