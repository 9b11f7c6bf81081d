"""Model execution: batch -> model inputs, forward passes, KV tensors, attention backends."""
