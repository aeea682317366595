"""Kernels (Triton) that attention backends call."""
