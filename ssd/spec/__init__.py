"""Speculative decoding: verification, draft proposers and SSD."""
