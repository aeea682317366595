"""Speculative decoding: proposers of draft tokens and the verification of them."""
