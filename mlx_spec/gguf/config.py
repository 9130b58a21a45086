"""A GGUF header -> the mlx-lm model config (config.json's keys) of the same architecture.

llama.cpp names its hyper-parameters `<arch>.<key>`; each supported
architecture maps them onto the mlx-lm model class that computes the same
function. Architectures not listed are refused in one sentence.
"""

from __future__ import annotations

# GGUF architecture -> mlx-lm model_type
ARCHITECTURES = {
    "llama": "llama",  # Llama 1-3, SmolLM/SmolLM2, Mistral 7B, TinyLlama ...
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
}

# Architectures whose Q and K projections llama.cpp's converter permuted for its
# interleaved ("normal") RoPE layout; mlx-lm's models expect the Hugging Face layout.
PERMUTED_QK = {"llama", "mistral"}

# Architectures whose RMSNorm weights llama.cpp stored as w + 1 (Gemma's norm multiplies by 1 + w).
NORM_PLUS_ONE = {"gemma3"}


def _get(metadata, arch, key, default=None, required=True):
    full = f"{arch}.{key}"
    if full in metadata:
        return metadata[full]
    if required and default is None:
        raise ValueError(f"The GGUF file has no '{full}' in its metadata; it cannot be read "
                         "as a complete model.")
    return default


def architecture(metadata) -> str:
    arch = metadata.get("general.architecture")
    if arch is None:
        raise ValueError("The GGUF file names no architecture (general.architecture); it is "
                         "not a model file llama.cpp wrote.")
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"GGUF architecture '{arch}' is not supported (supported: {supported}); "
                         "convert the model with mlx_lm.convert from its Hugging Face weights.")
    return arch


def model_config(metadata, vocab_size: int, tied: bool) -> dict:
    """The mlx-lm config for this file. `vocab_size` and `tied` come from the tensors
    (the embedding's rows, whether an output matrix is stored)."""
    arch = architecture(metadata)
    heads = int(_get(metadata, arch, "attention.head_count"))
    hidden = int(_get(metadata, arch, "embedding_length"))
    config = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(_get(metadata, arch, "block_count")),
        "intermediate_size": int(_get(metadata, arch, "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_get(metadata, arch, "attention.head_count_kv", heads)),
        "rms_norm_eps": float(_get(metadata, arch, "attention.layer_norm_rms_epsilon")),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": bool(tied),
        "rope_theta": float(_get(metadata, arch, "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_get(metadata, arch, "context_length", 4096)),
    }
    head_dim = _get(metadata, arch, "attention.key_length", None, required=False)
    config["head_dim"] = int(head_dim) if head_dim is not None else hidden // heads
    scaling = _get(metadata, arch, "rope.scaling.type", None, required=False)
    if scaling not in (None, "none"):
        factor = float(_get(metadata, arch, "rope.scaling.factor", 1.0))
        if scaling == "linear":
            config["rope_scaling"] = {"type": "linear", "factor": factor}
        elif scaling == "yarn":
            config["rope_scaling"] = {
                "type": "yarn", "factor": factor,
                "original_max_position_embeddings": int(_get(
                    metadata, arch, "rope.scaling.original_context_length",
                    config["max_position_embeddings"])),
            }
        else:
            raise ValueError(f"The GGUF file's RoPE scaling '{scaling}' is not supported.")
    if arch == "qwen2":
        config["attention_bias"] = True  # Qwen2's q/k/v projections carry biases
    if arch == "gemma3":
        window = _get(metadata, arch, "attention.sliding_window", 512)
        config.update({
            "sliding_window": int(window),
            # as llama.cpp: Gemma 3 27B (62 layers) scales by hidden / heads, the others by head_dim
            "query_pre_attn_scalar": float(
                hidden // heads if config["num_hidden_layers"] == 62 else config["head_dim"]),
            "rope_local_base_freq": 10000.0,
            "sliding_window_pattern": 6,
        })
    return config
