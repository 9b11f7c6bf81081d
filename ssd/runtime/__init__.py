"""The runtime of a model: its runner (batch -> model inputs -> one forward pass over the paged KV tensors), CUDA
graphs over static batches, host-to-device transfer and memory planning."""
