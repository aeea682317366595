"""The worker: one rank — its model runner, KV cache tensors, captured graphs."""
