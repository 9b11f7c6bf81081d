"""Speculative methods: the proposer interface, the draft-model and n-gram proposers, shared drafting, adaptive
lookahead, and SSD's draft process (``async_draft``). Verification lives beside the sampler
(``ssd.sample.rejection``)."""
