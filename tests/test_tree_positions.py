"""Token trees only where the model's positions follow the tree's (tree_verify.positions_follow).

A tree pass places node i at offset + depth[i] by patching mx.fast.rope; GPT-2 and GPT
BigCode add learned position embeddings read from the cache's offset, so a node would get its
flattened index, not its depth, and trees gave wrong greedy text (a call's and a batch's).
The probe (one node beside its sibling against that node decoded after the root alone, once
per model) keeps such models on chains; the control (the probe forced true) shows the fault.
"""

import importlib

import mlx.core as mx
import pytest

from families import plain_greedy, settled
from test_unbatchable import make
from tiny import make_llama

import mlx_spec.tree_verify as tree_verify
from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.generate import speculative_generate_step
from mlx_spec.tree_verify import positions_follow

PROMPTS = [[5, 17, 3, 40, 9, 5, 17, 3], [1, 2, 3]]


def gpt2(noise=0.0):
    module = importlib.import_module("mlx_lm.models.gpt2")
    mx.random.seed(0)
    return settled(module.Model(module.ModelArgs.from_dict(dict(
        model_type="gpt2", n_ctx=4096, n_embd=64, n_head=4, n_layer=2, n_positions=4096,
        layer_norm_epsilon=1e-5, vocab_size=64))), noise=noise)


def models(name):
    return (gpt2(), gpt2(0.05)) if name == "gpt2" else (make(name), make(name, noise=0.05))


def call(target, draft):
    rounds = list(speculative_generate_step(PROMPTS[0], target, draft, max_tokens=24,
                                            num_draft_tokens=3, tree=(3, 2),
                                            prompt_lookup=False))
    return [t for r in rounds for t in r.tokens], sum(r.tree_nodes > 0 for r in rounds)


def rows(engine):
    """Each prompt's tokens (rows side by side, or one after another as `room` allows) and
    the tree rounds."""
    waiting, uids, out, trees = list(PROMPTS), [], {}, 0
    while waiting or engine.busy:
        while waiting and engine.room:
            uids.append(engine.insert(RowRequest(waiting.pop(0), 24, prompt_lookup=False)))
            out[uids[-1]] = []
        for o in engine.step():
            out[o.uid] += o.tokens
            trees += bool(o.tree_nodes)
    return [out[uid] for uid in uids], trees


def test_the_probe():
    assert positions_follow(make_llama(vocab_size=64, seed=0))
    assert positions_follow(make("plamo3")) and positions_follow(make("afm7"))  # (rope; windows)
    assert not positions_follow(gpt2()) and not positions_follow(make("gpt_bigcode"))


@pytest.mark.parametrize("name", ["gpt2", "gpt_bigcode"])
def test_models_with_their_own_positions_keep_chains_and_their_text(name, monkeypatch):
    target, draft = models(name)
    expected = plain_greedy(target, PROMPTS[0], 24)
    assert call(target, draft) == (expected, 0)
    alone = BatchEngine(target, draft, max_rows=1, num_draft_tokens=3, tree=(3, 2),
                        calibration=None)  # (GPT BigCode's row on its own cache kinds)
    assert rows(alone)[0][0] == expected
    if name == "gpt2":  # it batches: rows side by side
        got, trees = rows(BatchEngine(target, draft, num_draft_tokens=3, tree=(3, 2),
                                      calibration=None))
        assert got == [plain_greedy(target, p, 24) for p in PROMPTS] and trees == 0
    # the control: a tree pass on such a model gives other text
    target, draft = models(name)
    monkeypatch.setattr(tree_verify, "positions_follow", lambda model: True)
    tokens, trees = call(target, draft)
    assert trees > 0 and tokens != expected


@pytest.mark.parametrize("name", ["afm7", "plamo3"])
def test_a_row_alone_on_its_own_cache_kinds_verifies_trees(name):
    """Families that cannot share a batch take a call's tree pass one row at a time
    (batch/solo.py): the target's greedy text, with tree rounds."""
    target, draft = models(name)
    engine = BatchEngine(target, draft, max_rows=1, num_draft_tokens=3, tree=(3, 2),
                         calibration=None)
    got, trees = rows(engine)
    assert got == [plain_greedy(target, p, 24) for p in PROMPTS] and trees > 0
