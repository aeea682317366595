"""Compile attnserve's Triton attention kernels for a CUDA target without a GPU, and print each
variant's registers, stack (spills) and shared memory, as ptxas reports them.

    PYTHONPATH=src python tools/kernel_resources.py            # sm_90 (H100 / H200)
    PYTHONPATH=src python tools/kernel_resources.py --arch 89

The interpreter (TRITON_INTERPRET=1) never runs Triton's code generator; this does, down to the
cubin, so a kernel change that cannot compile for the GPU, or that spills, shows up on a CPU-only
machine. Arguments get the 16-divisibility the launcher gives aligned pointers and strides.
Needs only the triton wheel (its ptxas and cuobjdump).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attnserve.attention.ops import triton_cache, triton_decode, triton_prefill

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
HEADS = {"NUM_KV_HEADS": 8, "HEAD_SIZE": 128, "HEAD_PAD": 128, "BLOCK_SIZE": 16}
OFF = {"USE_WINDOW": False, "USE_ALIBI": False, "USE_SOFTCAP": False, "DOT_FP32": False}


def _compile(
    fn: Any, types: dict[str, str], constants: dict[str, Any], arch: int, **options: Any
) -> Any:
    params = list(inspect.signature(fn.fn).parameters)
    signature = {p: "constexpr" if p in constants else types.get(p, "i32") for p in params}
    unspecialized = set(fn.do_not_specialize) | set(
        getattr(fn, "do_not_specialize_on_alignment", ())
    )
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, p in enumerate(params)
        if p not in constants and p not in unspecialized and i not in unspecialized
        and (signature[p].startswith("*") or p.startswith("stride"))
    }  # fmt: skip
    source = ASTSource(fn, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def _resources(kernel: Any) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        out = subprocess.run(
            [CUOBJDUMP, "--dump-resource-usage", cubin.name], capture_output=True, text=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    registers, stack = found.groups() if found else ("?", "?")
    return f"registers {registers:>3}  stack {stack:>3}  shared {kernel.metadata.shared:>6}"


def _variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, int]]]:
    rows = []
    for fp8 in (False, True):
        cache = "*u8" if fp8 else "*bf16"
        tag = "fp8 " if fp8 else "bf16"
        write_types = {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": cache,
                       "slot_ptr": "*i64", "scales_ptr": "*fp32"}  # fmt: skip
        write = {**HEADS, "BLOCK_T": 16, "FP8": fp8, "HW_CAST": True}
        rows.append((f"{tag} cache write", triton_cache._reshape_and_cache_kernel, write_types,
                     write, {}))  # fmt: skip
        decode_types = {"q_ptr": "*bf16", "cache_ptr": cache, "table_ptr": "*i32",
                        "seq_lens_ptr": "*i32", "slopes_ptr": "*bf16", "out_ptr": "*bf16",
                        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "scales_ptr": "*fp32",
                        "sm_scale": "fp32", "soft_cap": "fp32"}  # fmt: skip
        for block_n, warps, stages in ((32, 4, 3), (64, 4, 3), (128, 4, 3), (64, 2, 5)):
            decode = {**HEADS, **OFF, "NUM_HEADS": 32, "GROUP": 4, "GROUP_PAD": 16,
                      "BLOCK_N": block_n, "SPLIT_KEYS": True, "FP8": 2 if fp8 else 0}  # fmt: skip
            rows.append((f"{tag} decode {block_n} keys, {warps} warps, {stages} stages",
                         triton_decode._paged_decode_kernel, decode_types, decode,
                         {"num_warps": warps, "num_stages": stages}))  # fmt: skip
        prefill_types = {"q_ptr": "*bf16", "k_src": "*bf16", "v_src": "*bf16",
                         "cache_ptr": cache, "table_ptr": "*i32", "seq_lens_ptr": "*i32",
                         "query_start_ptr": "*i32", "slopes_ptr": "*bf16", "out_ptr": "*bf16",
                         "scales_ptr": "*fp32", "sm_scale": "fp32", "soft_cap": "fp32"}  # fmt: skip
        for fresh, block_m in ((0, 128), (1, 256)):
            prefill = {**HEADS, **OFF, "GROUP": 4, "GROUP_PAD": 4, "BLOCK_M": block_m,
                       "BLOCK_N": 64, "FP8": fp8, "PLAIN": True, "HAS_CONTEXT": True,
                       "FRESH": fresh}  # fmt: skip
            source = "keys from the cache" if fresh == 0 else "new keys by pointers"
            rows.append((f"{tag} prefill {block_m}x64, {source}",
                         triton_prefill._paged_prefill_kernel, prefill_types, prefill,
                         {"num_warps": 8, "num_stages": 3}))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    args = parser.parse_args()
    for name, fn, types, constants, options in _variants():
        print(f"{name:<44} {_resources(_compile(fn, types, constants, args.arch, **options))}")


if __name__ == "__main__":
    main()
