"""Gemma 2 in a batch. Its attention groups queries by key head, (B, kv heads, repeats, L, D),
and adds the mask to scores of that shape: a padded batch's mask (B, 1, L, S) then lines its
batch axis up with the key heads (wrong logits where the rows are as many as the key heads, a
crash otherwise), so the batch once refused it. The batch's attention layers now hand such a
model its mask with an axis for the repeats (batch/kv.py `grouped`, token trees' masks too),
and Gemma 2 decodes in a batch exactly: each row its own greedy tokens, beside rows of other
lengths, drafting chains and trees; a call is unchanged. The control takes the axis away and
must see the fault again.
"""

import importlib

import mlx.core as mx
import pytest
from mlx.utils import tree_map_with_path
from families import decode_rows, plain_greedy, settled, through_the_batch

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.batch import kv
from mlx_spec.batch.kv import batchable
from mlx_spec.generate import speculative_generate_step
from mlx_spec.server.worker import can_batch

PROMPTS = [[5, 17, 3, 40, 9, 5, 17, 3], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8],
           [33, 1, 33, 2, 33]]
NUM_TOKENS = 20


def make(seed=0, noise=0.0, kv_heads=2):
    """A tiny random Gemma 2 (mlx-lm's class), float32; `noise` perturbs it (a related draft).
    Its tied embeddings scaled down (0.1; times sqrt(hidden) at the input): greedy text that is
    not one token repeated (its soft-capped logits otherwise saturate)."""
    module = importlib.import_module("mlx_lm.models.gemma2")
    mx.random.seed(seed)
    args = dict(model_type="gemma2", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
                rms_norm_eps=1e-6, vocab_size=64, query_pre_attn_scalar=16, rope_theta=10000.0)
    model = module.Model(module.ModelArgs.from_dict(args))
    model.set_dtype(mx.float32)
    model.update(tree_map_with_path(lambda path, w: (w + noise * mx.random.normal(w.shape)) * (
        0.1 if "embed" in path else 1.0) if w.ndim >= 2 else w, model.parameters()))
    return settled(model, scale=1.0)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_rows_through_the_batchs_cache_equal_each_row_alone(kv_heads):
    """Two rows (one left-padded) as many as the key heads (2: the silent case), more (1) and
    with no grouping at all (4: one query head a key head, the mask as any model's)."""
    assert through_the_batch(make(kv_heads=kv_heads)) == "exact"


def test_without_the_axis_the_fault_shows(monkeypatch):
    """The control: the batch's mask as it was (B, 1, L, S) gives wrong logits (two rows, two
    key heads) or a crash (one key head)."""
    monkeypatch.setattr(kv, "GROUPED_QUERIES", ())
    assert through_the_batch(make()) == "wrong"
    assert through_the_batch(make(kv_heads=1)) == "crash"


def test_the_batch_and_the_server_take_it():
    target = make()
    assert batchable(target) and can_batch(target, make(seed=1))
    assert "gemma2" not in kv.UNBATCHABLE


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("tree", [None, (3, 2)])
def test_batched_rows_equal_their_own_greedy_decoding(rows, tree):
    target, draft = make(), make(noise=0.005)
    engine = BatchEngine(target, draft, num_draft_tokens=3, tree=tree)
    got, drafted, accepted = decode_rows(
        engine, [RowRequest(p, NUM_TOKENS, prompt_lookup=False) for p in PROMPTS[:rows]])
    assert 0 < accepted < drafted  # drafts kept and rejected: rows rewound by other amounts
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == plain_greedy(target, prompt, NUM_TOKENS)


def test_the_policy_and_lookup_beside_the_draft():
    """The defaults (the batch's policy, prompt lookup first), rows of four lengths."""
    target = make()
    got, _, _ = decode_rows(BatchEngine(target, make(noise=0.005)),
                            [RowRequest(p, NUM_TOKENS) for p in PROMPTS])
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == plain_greedy(target, prompt, NUM_TOKENS)


def test_a_call_is_unchanged():
    target = make()
    rounds = list(speculative_generate_step(PROMPTS[0], target, make(noise=0.005),
                                            max_tokens=24, num_draft_tokens=3))
    assert [t for r in rounds for t in r.tokens] == plain_greedy(target, PROMPTS[0], 24)
    assert 0 < sum(r.num_accepted for r in rounds) < sum(r.num_drafted for r in rounds)
