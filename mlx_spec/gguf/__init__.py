"""GGUF files (llama.cpp, LM Studio, Ollama): read into MLX models and mlx-lm tokenizers."""
