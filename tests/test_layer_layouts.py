"""Layouts found by sweeping mlx-lm's families through every path (a call's chains and trees,
rows side by side, a row alone), each exact or refused in one sentence:

- Nemotron-NAS with attention layers replaced by linear ones: mlx-lm still makes them a
  KVCache, which their attention never writes (no keys). A rewind, a roll of the batch's
  rows, a tree's kept path skip such a layer (they crashed on it), and a batch reads its rows'
  lengths off a written layer. Where the first layer is the unwritten one, every layer's mask
  is made from it (create_attention_mask(h, cache[0])): a batch refuses it in one sentence, a
  row alone (batch/solo.py) and a call decode it (chains: the tree probe fails there).
- DeepSeek-V4.1's compressed cache (LayerCache: no rewind path): a row alone decodes it
  plainly, and with a drafter refuses it in the sentence a call gives (it was taken, then
  crashed at its prefill).
- Phixtral's vocabulary is `num_vocab` (it was refused: "vocabulary size cannot be read").
"""

import importlib

import mlx.core as mx
import pytest

from families import plain_greedy, settled

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.generate import speculative_generate_step
from mlx_spec.tree_verify import positions_follow

PROMPTS = [[5, 17, 3, 40, 9, 5, 17, 3], [1, 2, 3]]
N = 24
TINY = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, vocab_size=64,
            rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
            rope_scaling=None, hidden_act="silu")
ATTENTION, LINEAR = {"n_heads_in_group": 2}, {"replace_with_linear": True}


def build(model_type, noise=0.0, **config):
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(0)
    return settled(module.Model(module.ModelArgs.from_dict(
        dict(TINY, model_type=model_type, **config))), noise=noise)


def nas(first, second, noise=0.0):
    return build("nemotron-nas", noise, block_configs=[
        {"attention": first, "ffn": {"ffn_mult": 2.0}},
        {"attention": second, "ffn": {"ffn_mult": 2.0}}])


def call(target, draft, **options):
    rounds = list(speculative_generate_step(PROMPTS[0], target, draft, max_tokens=N,
                                            num_draft_tokens=3, prompt_lookup=False, **options))
    return [t for r in rounds for t in r.tokens], sum(r.tree_nodes > 0 for r in rounds)


def rows(engine):
    """Each prompt's tokens: side by side, or one after another as `room` allows."""
    waiting, uids, out = list(PROMPTS), [], {}
    while waiting or engine.busy:
        while waiting and engine.room:
            uids.append(engine.insert(RowRequest(waiting.pop(0), N, prompt_lookup=False)))
            out[uids[-1]] = []
        for o in engine.step():
            out[o.uid] += o.tokens
    return [out[uid] for uid in uids]


def test_an_unwritten_layer_after_a_written_one_batches():
    target, draft = nas(ATTENTION, LINEAR), nas(ATTENTION, LINEAR, 0.05)
    expected = [plain_greedy(target, p, N) for p in PROMPTS]
    tokens, trees = call(target, draft, tree=(3, 2))
    assert tokens == expected[0] and trees > 0
    for tree in (None, (3, 2)):
        assert rows(BatchEngine(target, draft, num_draft_tokens=3, tree=tree,
                                calibration=None)) == expected, tree


def test_an_unwritten_first_layer_decodes_alone_and_a_batch_refuses_it():
    target, draft = nas(LINEAR, ATTENTION), nas(LINEAR, ATTENTION, 0.05)
    expected = [plain_greedy(target, p, N) for p in PROMPTS]
    assert not positions_follow(target)  # (its tree pass's mask cannot reach that layer)
    assert call(target, draft, tree=(3, 2)) == (expected[0], 0)
    with pytest.raises(ValueError, match="first attention layer is one its attention never"):
        BatchEngine(target, draft, num_draft_tokens=3, calibration=None)
    engine = BatchEngine(target, draft, max_rows=1, num_draft_tokens=3, calibration=None)
    assert engine.solo and rows(engine) == expected


def test_a_cache_no_rewind_handles_decodes_plainly_alone_and_a_drafter_is_one_sentence():
    """DeepSeek-V4.1's compressed LayerCache: a row alone decodes it plainly (lookup off, as a
    call's with no drafter), its greedy text; with a draft model, the sentence a call gives
    (it was taken, then crashed at its prefill)."""
    from mlx_lm.models.cache import make_prompt_cache

    def v41(noise=0.0):
        return build("deepseek_v41", noise, n_routed_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                     kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                     v_head_dim=8, index_head_dim=8, index_n_heads=2, index_topk=4)

    target = v41()
    assert "LayerCache" in {type(c).__name__ for c in make_prompt_cache(target)}
    engine = BatchEngine(target, None, max_rows=1, calibration=None)
    assert engine.plain_only and rows(engine) == [plain_greedy(target, p, N) for p in PROMPTS]
    with pytest.raises(ValueError, match="LayerCache: neither trimmable nor recurrent"):
        BatchEngine(target, v41(0.05), max_rows=1, calibration=None)


def test_a_vocabulary_named_num_vocab_is_read():
    from mlx_spec.loading import vocab_size

    target = build("phixtral", num_vocab=64, model_dim=32, num_heads=4, num_layers=2,
                   rotary_dim=4, num_experts=4, num_experts_per_tok=2)
    draft = build("phixtral", 0.05, num_vocab=64, model_dim=32, num_heads=4, num_layers=2,
                  rotary_dim=4, num_experts=4, num_experts_per_tok=2)
    assert vocab_size(target) == 64
    assert call(target, draft)[0] == plain_greedy(target, PROMPTS[0], N)
