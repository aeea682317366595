"""The native (C) CPU code in one place: the kernels' C sources (`cpu_ops.c`: the model's small
ops; `gguf_cpu.c`: the GGUF weight kernels; `cpu_attention.c`: paged attention), the thread pool
they share (`native_pool.c`) and their headers (`native_*.h`), the loader that builds and loads
them (`build`), the kernels' Python entry points whose calls a CPU graph records (`calls`), and
the C replay of such a graph (`graph.c`; the graph itself: `worker.graphs.cpu`). The Python
bindings of each kernel library live beside their callers (`model.layers.cpu_ops`,
`model.quantization.gguf_cpu`, `attention.ops.cpu_attention`) and load their source from here by
name (`build.load_native`).
"""
