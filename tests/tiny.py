"""Tiny random llama models (mlx-lm's own class) and model directories for tests."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama


def make_llama(vocab_size=64, hidden=48, layers=2, heads=4, kv_heads=2, seed=0,
               weight_scale=3.0):
    """A random llama with untied embeddings (tied random models just echo).

    Matrices are scaled up from mlx's default init so the output depends on
    the whole context instead of repeating one token.
    """
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=hidden * 2, num_attention_heads=heads, rms_norm_eps=1e-5,
        vocab_size=vocab_size, num_key_value_heads=kv_heads, tie_word_embeddings=False,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    model.update(tree_map(lambda w: w * weight_scale if w.ndim == 2 else w,
                          model.parameters()))
    mx.eval(model.parameters())
    return model


_ONCE = {}


def once(key, compute, holds=()):
    """compute(), run once a session per `key`: for models and references that tests only
    read. `key` may name objects in `holds` by id(); they are kept alive here, so no other
    object can take their ids."""
    key = (tuple(id(o) for o in holds), key)
    if key not in _ONCE:
        _ONCE[key] = (holds, compute())
    return _ONCE[key][1]


def shared_llama(**kwargs):
    """make_llama(**kwargs), built once a session: for the tests that only decode with it."""
    return once(("llama", tuple(sorted(kwargs.items()))), lambda: make_llama(**kwargs))


def perturbed(model, noise=0.05, seed=1):
    """A related-but-worse copy: the same weights plus Gaussian noise."""
    clone = llama.Model(model.args)
    key = mx.random.key(seed)
    params = dict(tree_flatten(model.parameters()))
    noisy = {}
    for i, (name, w) in enumerate(params.items()):
        scale = noise * (mx.std(w).item() if w.size > 1 else 0.0)
        noisy[name] = w + scale * mx.random.normal(w.shape, key=mx.random.split(key, i + 2)[i + 1])
    clone.load_weights(list(noisy.items()))
    mx.eval(clone.parameters())
    return clone


def write_tokenizer(path: Path, vocab_size=300, chat_template=None):
    """A byte-level BPE tokenizer with an EOS token, trained on a little Python."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n"] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "eos_token": "<|endoftext|>", "model_max_length": 2048}
    if chat_template:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def write_model_dir(path: Path, vocab_size=300, hidden=48, layers=2, seed=0,
                    chat_template=None) -> Path:
    """A complete Hugging Face-layout model directory mlx_lm.load can read."""
    path.mkdir(parents=True, exist_ok=True)
    real_vocab = write_tokenizer(path, vocab_size, chat_template)
    model = make_llama(vocab_size=real_vocab, hidden=hidden, layers=layers, seed=seed)
    config = {
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": hidden * 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "vocab_size": real_vocab, "tie_word_embeddings": False,
        "eos_token_id": 0,
    }
    (path / "config.json").write_text(json.dumps(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path
