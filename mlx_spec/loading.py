"""Loading models (local directory, Hugging Face repo or GGUF file) and checking a pair fits
(one vocabulary, or a bridge between two).

`load` is mlx-lm's loader with clear errors; a GGUF file (or a directory holding
one) is read by `mlx_spec.gguf`; with no path it loads the small target/draft
pair shipped inside the package.
"""

from __future__ import annotations

import json
import os
from numbers import Integral
from pathlib import Path
from typing import Optional, Tuple

from mlx_lm.tokenizer_utils import TokenizerWrapper


from .default_models import DEFAULT_DRAFT_PATH, DEFAULT_TARGET_PATH


def default_target_path() -> Path:
    return DEFAULT_TARGET_PATH


def default_draft_path() -> Path:
    return DEFAULT_DRAFT_PATH


def _looks_like_repo_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~"))


GGUF_OPTIONS = ("dequantize", "dtype")
GGUF_REPORT_ATTR = "_mlx_spec_gguf_report"
TOKENIZER_ATTR = "_mlx_spec_tokenizer"  # the tokenizer `load` read with the model


def load(path_or_hf_repo: Optional[str] = None, **kwargs) -> Tuple[object, TokenizerWrapper]:
    """Load `(model, tokenizer)` from a local directory, a Hugging Face repo id or a GGUF file.

    With no argument, loads the shipped default target model. A `.gguf` file
    (any name: an Ollama blob has no suffix) or a directory holding one file
    is converted in memory (`mlx_spec.gguf`; keywords `dequantize=True` keeps
    quantized matrices in floats, `dtype=` picks the float type; what was done
    is `gguf_report(model)`). `adapter_path`: mlx-lm's LoRA (or DoRA, or full)
    fine-tuning output (`mlx_lm.lora`: adapter_config.json and adapters.safetensors),
    applied as mlx-lm applies it, to a GGUF file's model too. Other keyword arguments go
    to `mlx_lm.load`. Raises ValueError with a readable sentence when the model cannot be
    found or read.
    """
    import mlx_lm

    path = str(path_or_hf_repo) if path_or_hf_repo is not None else str(default_target_path())
    path = os.path.expanduser(path)
    if not Path(path).exists() and not _looks_like_repo_id(path):
        raise ValueError(
            f"Model path '{path}' does not exist; give a local model directory, a GGUF file "
            "or a Hugging Face repo id such as mlx-community/Qwen2.5-0.5B-Instruct-4bit."
        )
    adapter_path = kwargs.pop("adapter_path", None)
    if adapter_path is not None:
        adapter_path = os.path.expanduser(str(adapter_path))
        check_adapter_path(adapter_path)
    gguf_path = _gguf_path(path)
    if gguf_path is not None:
        model, tokenizer = _load_gguf(gguf_path, kwargs)
        if adapter_path is not None:
            _with_adapters(model, adapter_path)
        return model, tokenizer
    try:
        loaded = mlx_lm.load(path, **kwargs)
    except ValueError:
        raise
    except Exception as exc:  # hub errors, missing files, unreadable weights
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = (
            " (HF_HUB_OFFLINE=1 is set and it is not in the local cache)" if offline else ""
        )
        raise ValueError(
            f"Could not load model '{path}'{hint}: {type(exc).__name__}: {exc}".strip()
        ) from exc
    if adapter_path is not None:  # (as mlx_lm.load applies them, with one sentence)
        _with_adapters(loaded[0], adapter_path)
    _remember_directory(loaded[0], path)
    object.__setattr__(loaded[0], TOKENIZER_ATTR, loaded[1])  # a draft of another vocabulary
    return loaded


def check_adapter_path(adapter_path) -> None:
    """ValueError, in one sentence, unless `adapter_path` is a directory holding mlx-lm's
    adapter files."""
    folder = Path(os.path.expanduser(str(adapter_path)))
    missing = [name for name in ("adapter_config.json", "adapters.safetensors")
               if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"adapter_path '{adapter_path}' holds no {' or '.join(missing)}; give "
                         "the directory mlx_lm.lora wrote (--adapter-path).")


def _with_adapters(model, adapter_path) -> None:
    """mlx-lm's adapters applied to `model` in place, as mlx_lm.load applies them."""
    from mlx_lm.tuner.utils import load_adapters

    try:
        load_adapters(model, str(adapter_path))
    except json.JSONDecodeError as exc:  # (a ValueError too: first)
        raise ValueError(f"{adapter_path}/adapter_config.json is not JSON ({exc.msg}).") from None
    except (AttributeError, KeyError, TypeError) as exc:  # a field it needs is missing
        raise ValueError(f"{adapter_path}/adapter_config.json lacks what mlx-lm needs "
                         f"({exc}); give the file mlx_lm.lora wrote.") from None
    except ValueError as exc:  # tensors of another model's shapes
        raise ValueError(f"The adapters in '{adapter_path}' do not fit this model: "
                         f"{' '.join(str(exc).split())}") from None
    model.eval()


def _gguf_path(path: str):
    """The GGUF file `path` names, or None for an MLX / Hugging Face model."""
    from .gguf.reader import find_gguf

    found = find_gguf(path)
    if found is None and Path(path).is_file():
        raise ValueError(f"'{path}' is a file but not a GGUF file (it does not start with the "
                         "GGUF magic); give a GGUF file or a model directory.")
    return found


def _load_gguf(path, options: dict):
    from .gguf.load import load_gguf

    unknown = sorted(set(options) - set(GGUF_OPTIONS))
    if unknown:
        raise ValueError(f"Loading a GGUF file takes only {', '.join(GGUF_OPTIONS)}, not "
                         f"{', '.join(unknown)}.")
    model, tokenizer, report = load_gguf(path, **options)
    object.__setattr__(model, GGUF_REPORT_ATTR, report)  # not a parameter of the model
    object.__setattr__(model, TOKENIZER_ATTR, tokenizer)
    return model, tokenizer


def gguf_report(model):
    """What loading a GGUF file did to each tensor (`GgufReport`), or None for other models."""
    return getattr(model, GGUF_REPORT_ATTR, None)


def _remember_directory(model, path: str) -> None:
    """Note on the model where it was read from: its MTP weights may be there (mlx-lm drops them)."""
    from mlx_lm.utils import hf_repo_to_path

    from .mtp import MODEL_DIR_ATTR

    try:
        directory = Path(path) if Path(path).exists() else hf_repo_to_path(path)
    except Exception:  # not resolvable offline: MTP drafting then needs mtp_weights
        return
    object.__setattr__(model, MODEL_DIR_ATTR, str(directory))  # not a parameter of the model


def vocab_size(model) -> int:
    """A model's vocabulary size (the tokens it reads and predicts; its logits may be padded
    wider, as OLMo's `embedding_size`): its `args.vocab_size` (or `config`'s, or Phixtral's
    `num_vocab`), else its
    embedding's rows, else those of the text model a multimodal wrapper holds, looked for
    through `model` and `language_model` (mlx-lm's mistral3, qwen2_vl, pixtral, llama4:
    `language_model`; gemma3n: `model.language_model`)."""
    parts, seen = [model], set()
    for part in parts:  # breadth first (each wrapper holds one text model: a few parts)
        if id(part) in seen:
            continue
        seen.add(id(part))
        for config in ("args", "config"):
            for name in ("vocab_size", "num_vocab"):  # (Phixtral's is num_vocab)
                size = getattr(getattr(part, config, None), name, None)
                if isinstance(size, Integral) and not isinstance(size, bool):
                    return int(size)
        embed = getattr(part, "embed_tokens", None)
        if embed is not None and hasattr(embed, "weight"):
            return int(embed.weight.shape[0])
        parts += [getattr(part, name) for name in ("model", "language_model")
                  if getattr(part, name, None) is not None]
    raise ValueError("The model's vocabulary size cannot be read: it has no args.vocab_size, "
                     "embed_tokens or language_model.")


def check_pair(target_model, draft_model, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Raise ValueError unless the draft speaks the target's vocabulary.

    A draft's embedding may be padded shorter than the target's (as in the
    Qwen2.5 family); with tokenizers given it must still cover every token.
    A draft of another vocabulary drafts across it (`assemble.draft_bridge`) instead.
    """
    if draft_tokenizer is not None and target_tokenizer is not None:
        if _vocab(draft_tokenizer) != _vocab(target_tokenizer):
            raise ValueError(
                "The draft model's tokenizer differs from the target's (mismatched "
                "vocabularies); pass both tokenizers to draft across them."
            )
    across = " (mismatched vocabularies); to draft across tokenizers pass the draft's " \
        "tokenizer as draft_tokenizer=, or load the draft with mlx_spec.load."
    target_size, draft_size = vocab_size(target_model), vocab_size(draft_model)
    if draft_size > target_size:
        raise ValueError(
            f"The draft model's vocabulary ({draft_size} tokens) is larger than the "
            f"target's ({target_size}){across}"
        )
    tokenizer_size = len(_vocab(target_tokenizer)) if target_tokenizer is not None else 0
    if draft_size < tokenizer_size:
        raise ValueError(
            f"The draft model's vocabulary ({draft_size} tokens) does not cover the "
            f"tokenizer's {tokenizer_size} tokens{across}"
        )


def tokenizer_of(model):
    """The tokenizer `load` read with `model`, or None."""
    return getattr(model, TOKENIZER_ATTR, None)


def _vocab(tokenizer) -> dict:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    return inner.get_vocab()
