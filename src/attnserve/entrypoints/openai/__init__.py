"""The OpenAI-compatible server (`attnserve serve`). Its modules import FastAPI, uvicorn and
prometheus-client, so only the `serve` command and the tests load them."""
