"""AFM 7 (mlx-lm's `afm7`: the last layers reuse an earlier layer's keys and values): a call
speculates exactly; the batch refuses it in one sentence, because its KV-reuse layers place a
row's queries by the cache buffer's length (rope offset S - L), not by the row's own offset,
so a row with left padding would get another row's positions (mlx-lm's BatchGenerator has the
same fault). The last test shows that fault through the batch's own cache: should mlx-lm
place those queries by the offsets one day, it fails, and the refusal can go."""

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models import afm7

from families import plain_greedy

from mlx_spec.batch import BatchEngine
from mlx_spec.batch.kv import BatchCache, batchable, row_cache
from mlx_spec.generate import speculative_generate_step
from mlx_spec.server.worker import can_batch

PROMPT = [5, 17, 3, 40, 9, 5, 17, 3]


def make_afm7(seed=0, noise=0.0):
    """A tiny random AFM 7 (4 layers, the last 2 reusing the keys and values of the one
    before them), float32; `noise` perturbs every matrix (a related draft)."""
    mx.random.seed(seed)
    model = afm7.Model(afm7.ModelArgs(model_type="afm7", vocab_size=64, hidden_dim=32,
                                      num_layers=4, num_kv_reuse_layers=2, num_heads=4,
                                      num_kv_heads=2))
    model.set_dtype(mx.float32)
    model.update(tree_map(lambda w: w * 3.0 if w.ndim >= 2 else w, model.parameters()))
    if noise:
        model.update(tree_map(lambda w: w + noise * mx.random.normal(w.shape)
                              if w.ndim >= 2 else w, model.parameters()))
    model.eval()
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def afm_pair():
    return make_afm7(), make_afm7(noise=0.05)


@pytest.mark.parametrize("k", [1, 3])
def test_a_call_speculates_exactly(afm_pair, k):
    target, draft = afm_pair
    rounds = list(speculative_generate_step(PROMPT, target, draft, max_tokens=30,
                                            num_draft_tokens=k))
    assert [t for r in rounds for t in r.tokens] == plain_greedy(target, PROMPT, 30)
    drafted = sum(r.num_drafted for r in rounds)
    assert 0 < sum(r.num_accepted for r in rounds) < drafted  # kept some, rewound others


def test_the_batch_refuses_it_in_one_sentence(afm_pair):
    target, draft = afm_pair
    assert not batchable(target)
    with pytest.raises(ValueError, match=r"target \(afm7\) places each row's queries"):
        BatchEngine(target)
    with pytest.raises(ValueError, match=r"draft model \(afm7\)"):
        BatchEngine(_llama(), draft)
    assert not can_batch(target, draft)  # the server serves it one request at a time


def _llama():
    from tiny import make_llama
    return make_llama(vocab_size=64, seed=1)


def test_a_padded_row_gets_other_positions_in_its_reuse_layers(afm_pair):
    """Two rows of 1 and 8 prompt tokens in the batch's cache: the longer row's logits are its
    own, the shorter (left-padded) row's are not what it gets alone."""
    target = afm_pair[0]
    heads, last = [[5], PROMPT[:-1]], [[17, 9], [3, 9]]
    cache = BatchCache(target)
    alone = []
    for head, tail in zip(heads, last):
        layers = row_cache(target)
        target(mx.array([head]), cache=layers)
        cache.join(layers)
        own = row_cache(target)
        target(mx.array([head]), cache=own)
        alone.append(target(mx.array([tail]), cache=own)[0])
    together = cache.forward(mx.array(last), undoable=False)
    assert mx.allclose(together[1], alone[1], atol=1e-4).item()
    assert not mx.allclose(together[0], alone[0], atol=1e-2).item()
