"""Bundled default models for offline use of ``mlx-spec generate``.

A tiny target/draft pair of Llama models (Hugging Face layout, float16 safetensors,
shared byte-level BPE tokenizer with ``<|endoftext|>`` as EOS) trained from scratch on
the Python standard library's source code by ``python -m training.train_default_models``.
They only know how to continue Python code; see ``README.md`` and ``metrics.json``
in this directory for sizes, data split and acceptance measurements.

``mtp/`` holds an MTP head trained for the target (DeepSeek-V3's layout, one Llama
decoder layer; ``mtp_config.json`` gives its shape): ``draft_model="mtp"`` finds it.
``dflash/`` holds a DFlash block drafter trained for the target by ``python -m
training.dflash`` and given DFlash2's candidate selector by ``python -m
training.dflash_selector`` (z-lab's DFlash2DraftModel layout): ``draft_model="dflash"`` finds it.
"""

from pathlib import Path

DEFAULT_TARGET_PATH: Path = Path(__file__).resolve().parent / "target"
DEFAULT_DRAFT_PATH: Path = Path(__file__).resolve().parent / "draft"
DEFAULT_MTP_PATH: Path = Path(__file__).resolve().parent / "mtp"
DEFAULT_DFLASH_PATH: Path = Path(__file__).resolve().parent / "dflash"
