"""Attention backends: one file each, holding its Backend, Metadata, Builder and Impl."""
