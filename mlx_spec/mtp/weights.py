"""MTP weights: finding them, reading only what holds them, and fitting them to the block.

mlx-lm's `sanitize` drops MTP tensors when it loads a model, so they are read
here, from one of:

- the model's own directory (recorded by `mlx_spec.load`), when its
  safetensors still hold them;
- `mtp_weights=PATH`: a local directory of a checkpoint (the original one);
- `mtp_weights="owner/name"`: a Hugging Face repo, through huggingface_hub
  (the index, then only the shards needed; with HF_HUB_OFFLINE=1 from the
  local cache).

With an index (model.safetensors.index.json) only the shards that hold MTP
tensors are opened, and `mx.load` is lazy, so of those only the MTP tensors
are read. The layer's copies of the embedding and output head (DeepSeek's
`embed_tokens`, `shared_head.head`) are not read: the target's own are used.

Layouts: a shard written by mlx-lm (safetensors metadata format "mlx")
already holds mlx-lm's form; any other is the original checkpoint's, whose
Qwen norms are zero-centred (1 + w: mlx-lm adds the 1 when it loads, so
this does too) and whose experts are stored one by one (stacked here).
DeepSeek-style layers go through the target's own `sanitize` (fp8
dequantization, the split of kv_b_proj, stacked experts) under a trunk
layer's name. Weights stay 16-bit: wider floats become bfloat16, 16-bit
ones are kept as stored, nothing is quantized.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from .heads import QWEN, text_model

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_MTP_DTYPE = mx.bfloat16  # for floats wider than 16 bits
SHARED_COPIES = ("embed_tokens.", "shared_head.head.")  # the target's own are used
QWEN_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
              "input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
              "k_norm.weight")
EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(\w+_proj)\.weight$")


def local_name(style: str, name: str, num_layers: Optional[int]) -> Optional[str]:
    """A checkpoint tensor's name inside the MTP block, or None when it is not one to read.

    `num_layers` None: every `model.layers.{i}.*` is the layer's (a trained head's own file).
    """
    if style == QWEN:  # mtp.*, wherever the checkpoint nests it (language_model.mtp.*, ...)
        match = re.search(r"(?:^|\.)mtp\.(.+)$", name)
        return match.group(1) if match else None
    match = re.match(rf"model\.layers\.{num_layers if num_layers is not None else '[0-9]+'}\.(.+)$", name)
    local = match.group(1) if match else None
    return None if local is None or local.startswith(SHARED_COPIES) else local


# --- reading ---------------------------------------------------------------------------

def read_tensors(source: str, wanted: Callable[[str], Optional[str]]):
    """({local name: lazy array}, raw layout?, where) from a directory or a repo id."""
    path = Path(source).expanduser()
    if path.is_dir():
        return _read(_local_files(path), lambda f: str(path / f), wanted) + (str(path),)
    if path.exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        raise ValueError(f"mtp_weights '{source}' is neither a local directory nor a Hugging "
                         "Face repo id; give the directory (or repo) of the original checkpoint.")
    return _read(*_hub_files(source), wanted) + (f"the Hugging Face repo {source}",)


def _local_files(path: Path):
    """The weight map (tensor -> shard) of an indexed directory, else its safetensors files."""
    if (path / INDEX).exists():
        return json.loads((path / INDEX).read_text())["weight_map"]
    return sorted(p.name for p in path.glob("*.safetensors"))


def _hub_files(repo: str):
    """The repo's weight map (or its single file) and a function fetching one file (cached)."""
    from huggingface_hub import hf_hub_download

    def fetch(filename: str) -> str:
        try:
            return hf_hub_download(repo, filename)
        except Exception as exc:  # offline and not cached, no such repo or file, network
            raise ValueError(
                f"Could not get {filename} of the Hugging Face repo {repo} for its MTP weights "
                f"({type(exc).__name__}); with HF_HUB_OFFLINE=1 the index and the shards "
                "holding them must be in the local Hugging Face cache.") from exc

    try:
        return json.loads(Path(fetch(INDEX)).read_text())["weight_map"], fetch
    except ValueError:  # not sharded (or not reachable): the single file
        fetch(SINGLE)
        return [SINGLE], fetch


def _read(files, fetch: Callable[[str], str], wanted) -> Tuple[Dict[str, mx.array], bool]:
    """Open only the shards that hold wanted tensors (a weight map says which; a file list: all)."""
    if isinstance(files, dict):
        shards = sorted({shard for name, shard in files.items() if wanted(name)})
    else:
        shards = files
    tensors, raw = {}, False
    for shard in shards:
        path = fetch(shard)
        try:
            arrays, metadata = mx.load(path, return_metadata=True)  # lazy: reads the header only
        except Exception as exc:
            raise ValueError(f"Could not read the MTP weights' shard {path} ({exc}); check "
                             "that the checkpoint is complete.") from exc
        found = {local: arrays[name] for name in arrays if (local := wanted(name))}
        if found:
            raw = raw or (metadata or {}).get("format") != "mlx"
            tensors.update(found)
    return tensors, raw


# --- fitting ---------------------------------------------------------------------------

def convert(style: str, tensors: Dict[str, mx.array], raw: bool, model) -> Dict[str, mx.array]:
    """Checkpoint tensors (local names) -> the block's parameters, 16-bit."""
    if style == QWEN:
        tensors = _qwen_form(tensors, raw)
    else:
        tensors = _deepseek_form(tensors, model)
    keep = getattr(text_model(model), "cast_predicate", lambda name: True)
    return {name: (w.astype(DEFAULT_MTP_DTYPE) if _wide_float(w) and keep(name) else w)
            for name, w in tensors.items()}


def _wide_float(w: mx.array) -> bool:
    return mx.issubdtype(w.dtype, mx.floating) and w.dtype.size > 2


def _qwen_form(tensors, raw: bool):
    out, experts = {}, {}
    for name, w in tensors.items():
        if name.startswith("layers.") and not name.startswith("layers.0."):
            continue  # one MTP layer drafts every depth
        match = EXPERT.match(name)
        if match:  # one expert's matrix: stacked below
            experts.setdefault((match[1], match[3]), {})[int(match[2])] = w
        elif name.endswith(".experts.gate_up_proj"):  # fused experts (Qwen3.5 MoE): split
            prefix, mid = name[: -len(".experts.gate_up_proj")], w.shape[-2] // 2
            out[f"{prefix}.switch_mlp.gate_proj.weight"] = w[..., :mid, :]
            out[f"{prefix}.switch_mlp.up_proj.weight"] = w[..., mid:, :]
        elif name.endswith(".experts.down_proj"):
            out[name.replace(".experts.down_proj", ".switch_mlp.down_proj.weight")] = w
        elif raw and w.ndim == 1 and name.endswith(QWEN_NORMS):
            out[name] = w + 1.0  # zero-centred in the original checkpoint
        else:
            out[name] = w
    for (prefix, proj), by_index in experts.items():
        out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([by_index[e] for e in sorted(by_index)])
    return out


DEEPSEEK_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


def _deepseek_form(tensors, model):
    """The decoder layer's tensors through the target's sanitize, as if they were trunk layer 0."""
    own = {n: w for n, w in tensors.items() if n.startswith(DEEPSEEK_OWN)}
    layer = {f"model.layers.0.{n}": w for n, w in tensors.items() if n not in own}
    prefix = "model.layers.0."
    sanitized = text_model(model).sanitize(layer)
    own.update({f"block.{n[len(prefix):]}": w for n, w in sanitized.items() if n.startswith(prefix)})
    return own


def load_block(block, weights: Dict[str, mx.array], where: str) -> None:
    """Put `weights` into `block`; one ValueError sentence when they do not fit it."""
    expected = dict(tree_flatten(block.parameters()))
    if any(name.endswith(".scales") for name in weights):
        raise ValueError(f"The MTP weights in {where} are quantized; mlx-spec keeps MTP layers in "
                         "16 bits, so give the original checkpoint with mtp_weights=...")
    missing = sorted(expected.keys() - weights.keys())
    extra = sorted(weights.keys() - expected.keys())
    if missing or extra:
        what = f"{missing[0]} is missing" if missing else f"{extra[0]} is not part of it"
        raise ValueError(f"The MTP weights in {where} do not fit this target's MTP layer ({what}); "
                         "give the MTP weights of this very model.")
    for name, w in weights.items():
        if w.shape != expected[name].shape:
            raise ValueError(
                f"The MTP weights in {where} do not fit this target: {name} has shape "
                f"{tuple(w.shape)} where the target's MTP layer needs "
                f"{tuple(expected[name].shape)}; give the MTP weights of this very model.")
    block.load_weights(list(weights.items()))
