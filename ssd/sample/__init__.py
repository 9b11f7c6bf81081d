"""Sampling: logits processing (temperature, top-k, top-p), per-request random generators, and the rejection
sampling that verifies drafts (``rejection``)."""
