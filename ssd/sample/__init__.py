"""Sampling: logits processing (temperature, top-k, top-p) and per-request random generators."""
