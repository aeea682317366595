"""Entry points: the offline `LLM` API and the OpenAI-compatible server."""
