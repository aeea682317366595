"""Benchmarks run from the command line (`attnserve bench ...`)."""
