"""Model implementations (Llama, Qwen2, Qwen3) and checkpoint loading."""
