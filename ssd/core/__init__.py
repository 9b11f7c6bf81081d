"""Torch-free engine core: sequence state, KV block pool with prefix caching, scheduler."""
