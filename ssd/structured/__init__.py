"""Structured outputs: constrain a request's tokens to a JSON schema, a regular expression, a grammar or a choice.

``spec`` holds the request-level option (no grammar library needed to build or validate its shape);
``grammar`` compiles it against the model's tokenizer with llguidance and tracks each sequence's state;
``bitmask`` applies the allowed-token masks to logits rows.
"""
