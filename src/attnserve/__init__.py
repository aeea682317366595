"""attnserve: a fast, compact LLM inference and serving engine with pluggable attention."""

__version__ = "0.1.0"
