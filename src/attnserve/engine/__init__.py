"""The engine: requests, scheduling, and the paged KV block bookkeeping."""
