"""Text models inside mlx-lm's multimodal wrappers (`language_model`: Mistral Small 3.x's
mistral3, pixtral, qwen2_vl, Llama 4) speculate through a call and the batch: the vocabulary
size is read from the text model the wrapper holds (loading.vocab_size; every path crashed on
`embed_tokens` before), and each gives the target's own greedy tokens. Llama 4's chunked
attention (ChunkedKVCache) rewinds in a call, across a chunk's end; the batch refuses it."""

import importlib

import mlx.core as mx
import pytest

from families import plain_greedy, settled
from test_batch import run

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.generate import speculative_generate_step
from mlx_spec.loading import vocab_size

PROMPTS = [[5, 17, 3, 40, 9, 5, 17, 3], [1, 2, 3], [33]]
TEXT = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, vocab_size=64,
            rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
            rope_scaling=None)
INNER = {"mistral3": "llama", "pixtral": "llama", "qwen2_vl": "qwen2"}


def make(name, seed=0, noise=0.0):
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict({
        "model_type": name, "text_config": dict(TEXT, model_type=INNER[name]),
        "tie_word_embeddings": False}))
    return settled(model, noise=noise)


@pytest.mark.parametrize("name", sorted(INNER))
def test_a_wrapped_text_model_speculates_through_a_call_and_the_batch(name):
    target, draft = make(name), make(name, noise=0.05)
    assert vocab_size(target) == 64 and not hasattr(target, "embed_tokens")
    rounds = list(speculative_generate_step(PROMPTS[0], target, draft, max_tokens=20,
                                            num_draft_tokens=3))
    assert [t for r in rounds for t in r.tokens] == plain_greedy(target, PROMPTS[0], 20)
    got = run(BatchEngine(target, draft, num_draft_tokens=3),
              [RowRequest(p, 12, prompt_lookup=False) for p in PROMPTS])
    assert got == [plain_greedy(target, p, 12) for p in PROMPTS]


def test_a_model_whose_vocabulary_cannot_be_read_is_one_sentence():
    class Opaque:
        pass

    with pytest.raises(ValueError, match="vocabulary size cannot be read"):
        vocab_size(Opaque())


LLAMA4_TEXT = dict(TEXT, model_type="llama4_text", hidden_size=64, head_dim=16,
                   intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
                   interleave_moe_layer_step=2, no_rope_layers=[1, 1, 1, 0], use_qk_norm=True,
                   attention_chunk_size=8, num_hidden_layers=4, attention_bias=False)


def make_llama4(noise=0.0):
    """A tiny Llama 4 (chunked attention, chunks of 8)."""
    module = importlib.import_module("mlx_lm.models.llama4")
    mx.random.seed(0)
    return settled(module.Model(module.ModelArgs.from_dict(
        {"model_type": "llama4", "text_config": LLAMA4_TEXT})), noise=noise)


def test_llama4_speculates_across_its_attention_chunks_and_the_batch_refuses_it():
    target, draft = make_llama4(), make_llama4(noise=0.05)
    prompt = PROMPTS[0] + [11, 2, 8, 30, 1, 9]  # chunks of 8: the reply crosses three ends
    want = plain_greedy(target, prompt, 24)
    assert vocab_size(target) == 64 and len(set(want)) > 3
    rounds = list(speculative_generate_step(prompt, target, draft, max_tokens=24,
                                            num_draft_tokens=3, prompt_lookup=False))
    assert [t for r in rounds for t in r.tokens] == want
    assert 0 < sum(r.num_accepted for r in rounds) < sum(r.num_drafted for r in rounds)
    with pytest.raises(ValueError, match="one request at a time"):
        BatchEngine(target)
