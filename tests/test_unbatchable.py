"""Families whose code cannot share a batch (batch/kv.py UNBATCHABLE), found by running
mlx-lm's families through the batch: each speculates exactly in a call and is refused by the
batch (so the batched server serves it one request at a time) in one sentence. The last test
shows each fault through the batch's own cache, teacher-forced against the model alone on its
own caches, so it fails should mlx-lm mend one (and the refusal can go).

- AFM 7: its KV-reuse layers place queries by the buffer's length (rope offset S - L): a
  left-padded row gets another row's positions (wrong logits, silently).
- PLaMo 3: its sliding layers' mask is one wider than the RotatingKVCache it makes: alone the
  cache is the window, in a batch (whole histories kept) the mask's window would be (wrong).
- GPT BigCode: np.arange(cache[0].offset, ...), one position for every row (a crash).

(Gemma 2, refused here once, batches: tests/test_gemma2.py.)
"""

import importlib

import mlx.core as mx
import pytest

from families import plain_greedy, settled, through_the_batch

from mlx_spec.batch import BatchEngine
from mlx_spec.batch.kv import UNBATCHABLE, batchable
from mlx_spec.generate import speculative_generate_step
from mlx_spec.server.worker import can_batch

PROMPT = [5, 17, 3, 40, 9, 5, 17, 3]
ARGS = {
    "afm7": dict(vocab_size=64, hidden_dim=32, num_layers=4, num_kv_reuse_layers=2, num_heads=4,
                 num_kv_heads=2),
    "plamo3": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=64,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                   vocab_size=64, rope_theta=10000.0, max_position_embeddings=4096,
                   tie_word_embeddings=False, sliding_window=8),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_inner=64, n_head=4, n_positions=4096,
                        layer_norm_epsilon=1e-5, vocab_size=64),
}


def make(name, seed=0, noise=0.0):
    """A tiny random model of mlx-lm's `name` class, float32, every matrix scaled by 3 (outputs
    not degenerate); `noise` perturbs them (a related draft)."""
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(dict(ARGS[name], model_type=name)))
    return settled(model, noise=noise)


# what each does through the batch's cache, two rows (the second as many as the key heads)
FAULTS = {"afm7": "wrong", "plamo3": "wrong", "gpt_bigcode": "crash"}


def test_every_refused_family_is_tested_here():
    assert set(UNBATCHABLE) == set(ARGS) == set(FAULTS)


@pytest.mark.parametrize("name", sorted(ARGS))
def test_a_call_speculates_exactly(name):
    target, draft = make(name), make(name, noise=0.05)
    rounds = list(speculative_generate_step(PROMPT, target, draft, max_tokens=24,
                                            num_draft_tokens=3))
    assert [t for r in rounds for t in r.tokens] == plain_greedy(target, PROMPT, 24)
    assert 0 < sum(r.num_accepted for r in rounds) < sum(r.num_drafted for r in rounds)


@pytest.mark.parametrize("name", sorted(ARGS))
def test_the_batch_refuses_it_in_one_sentence(name):
    from tiny import make_llama

    target = make(name)
    assert not batchable(target)
    with pytest.raises(ValueError, match=rf"target \({name}\) cannot share a batch"):
        BatchEngine(target)
    with pytest.raises(ValueError, match=rf"draft model \({name}\) cannot share a batch"):
        BatchEngine(make_llama(vocab_size=64, seed=1), target)
    assert not can_batch(target, None)  # the server serves it one request at a time


@pytest.mark.parametrize("name", sorted(ARGS))
def test_the_fault_shows_through_the_batchs_cache(name):
    assert through_the_batch(make(name)) == FAULTS[name]


def test_a_batchable_family_goes_through_the_same_check_exactly():
    """The check itself on a family the batch takes (the control)."""
    from tiny import make_llama

    assert through_the_batch(make_llama(vocab_size=64, seed=0)) == "exact"
