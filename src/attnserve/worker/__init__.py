"""The worker: model execution, KV cache tensors, executors."""
