"""Export to the Hugging Face layout mlx_lm loads: float16 safetensors, config.json,
the tokenizer files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .models import LlamaConfig


def export_hf(model, cfg: LlamaConfig, tok_dir: Path, out: Path, eos_id: int):
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
          if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tok_dir / f, out / f)
