"""Gemma 3n with KV-shared layers (its last layers read the keys and values of an earlier
layer's cache, `keys_and_values()`): a call speculates exactly over its sliding windows, which
a call keeps in mlx-spec's rewindable WindowKVCache (cache/window.py: it had no
keys_and_values, so every call on such a checkpoint crashed), and the batch takes it too.
Also read through its two wrappers for the vocabulary size (loading.vocab_size)."""

import mlx.core as mx
import pytest
from mlx_lm.models import gemma3n

from families import plain_greedy, settled
from test_batch import run

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.generate import speculative_generate_step
from mlx_spec.loading import vocab_size

PROMPT = [5, 17, 3, 40, 9, 5, 17, 3, 11, 2, 8, 30, 1, 9]  # longer than its window of 8
TEXT = dict(model_type="gemma3n", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            vocab_size=64, vocab_size_per_layer_input=64, rope_theta=10000.0,
            rope_local_base_freq=10000.0, max_position_embeddings=4096, sliding_window=8,
            final_logit_softcapping=30.0, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
            activation_sparsity_pattern=[0.0] * 4, hidden_size_per_layer_input=8,
            altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
            altup_active_idx=0, laurel_rank=8, rope_scaling=None)


def make(seed=0, noise=0.0):
    """A tiny random Gemma 3n, float32, every matrix halved (larger weights give a
    constant reply); `noise` perturbs them (a related draft)."""
    mx.random.seed(seed)
    model = gemma3n.Model(gemma3n.ModelArgs.from_dict({
        "model_type": "gemma3n", "text_config": TEXT, "vocab_size": 64}))
    return settled(model, 0.5, noise)


@pytest.fixture(scope="module")
def pair():
    return make(), make(noise=0.05)


@pytest.mark.parametrize("k", [1, 3])
def test_a_call_with_kv_shared_layers_speculates_exactly(pair, k):
    target, draft = pair
    assert vocab_size(target) == 64
    want = plain_greedy(target, PROMPT, 24)
    assert len(set(want)) > 3  # (not a constant reply)
    rounds = list(speculative_generate_step(PROMPT, target, draft, max_tokens=24,
                                            num_draft_tokens=k, prompt_lookup=False))
    assert [t for r in rounds for t in r.tokens] == want
    assert 0 < sum(r.num_accepted for r in rounds) < sum(r.num_drafted for r in rounds)
    looked_up = list(speculative_generate_step(PROMPT, target, None, max_tokens=24,
                                               prompt_lookup=True))
    assert [t for r in looked_up for t in r.tokens] == want


def test_rows_in_a_batch_keep_their_greedy_tokens(pair):
    target, draft = pair
    prompts = [PROMPT, [1, 2, 3]]
    got = run(BatchEngine(target, draft, num_draft_tokens=3),
              [RowRequest(p, 16, prompt_lookup=False) for p in prompts])
    assert got == [plain_greedy(target, p, 16) for p in prompts]
