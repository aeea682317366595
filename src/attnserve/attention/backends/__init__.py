"""Attention backends: one file each, holding its Backend, Metadata, Builder and Impl; `utils`
holds the helpers several of them share."""
