"""mlx-spec: exact speculative decoding on MLX.

    from mlx_spec import load, generate
    target_model, tokenizer = load("mlx-community/Qwen2.5-7B-Instruct-4bit")
    draft_model, _ = load("mlx-community/Qwen2.5-0.5B-Instruct-4bit")
    text = generate(target_model, tokenizer, "Hello", draft_model=draft_model)

The API mirrors mlx-lm, so code ports by changing an import. With no path,
`load()` / `load_default_pair()` give the small pair shipped in the package.
"""

from .generate import (
    GenerationResponse,
    generate,
    speculative_generate_step,
    stream_generate,
)
from .loading import check_pair, load
from .sampling import SamplingConfig
from .stats import GenerationStats

__version__ = "0.1.0"


def load_default_pair():
    """Return `(target_model, draft_model, tokenizer)` for the shipped default pair."""
    from .loading import default_draft_path, default_target_path

    target_model, tokenizer = load(str(default_target_path()))
    draft_model, _ = load(str(default_draft_path()))
    return target_model, draft_model, tokenizer


__all__ = [
    "load",
    "load_default_pair",
    "generate",
    "stream_generate",
    "speculative_generate_step",
    "check_pair",
    "GenerationResponse",
    "GenerationStats",
    "SamplingConfig",
]
