"""More recurrent models, through the loop and the batch: the hybrids Granite 4.0-H (Mamba-2),
LFM2-MoE (short convolutions), Jamba (Mamba), PLaMo 2 (Mamba-2) and OLMo Hybrid (a Gated
DeltaNet), Falcon-H1 (attention and Mamba-2 state in one CacheList a layer), and models with
no attention layer, Mamba, Mamba-2 and RWKV-7 (in a batch each row
then has its state and no padding); Kimi-Linear, Kimi-K3, RecurrentGemma, Gear, Bailing-MoE-Linear,
the Bailing hybrid and Bailing-MoE-V3, and
Baichuan-M1, whose short convolution over keys and values lives in its attention layers (a call
rewinds it by re-running the model over the kept tokens; the batch, which re-runs mixers only,
refuses it in one sentence).

Tiny random models of mlx-lm's own classes (tests/families.py, `MORE_RECURRENT`), each drafted
for by its own weights quantized to 4 bits, so that rounds keep some of their drafts and reject
the rest (rows of one batch keeping different numbers of them) and caches rewind. Each must give mlx-lm's own greedy
tokens through a call (rewinding by its mixers alone, never the whole model) and through the
batch engine, rows of ragged prompts decoding together and a row alone (its recurrent state
restored and each row's kept prefix re-run: kv.py).
"""

import pytest
from families import MORE_RECURRENT, decode_rows, shared_family, shared_plain_greedy

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.batch.kv import batchable
from mlx_spec.generate import speculative_generate_step

# Its recurrent state inside the attention layer: a call rewinds by the model, the batch refuses
REWOUND_BY_THE_MODEL = ("baichuan_m1",)
PROMPT = [5, 17, 3, 40, 9, 5, 17, 3]
PROMPTS = [PROMPT, [1, 2, 3], [9, 8, 7, 6, 5, 4, 3], [33, 1, 33, 2, 33]]
NUM_TOKENS = 24


@pytest.mark.parametrize("name", MORE_RECURRENT)
def test_a_call_keeps_parity_and_rewinds_by_the_mixers(name):
    target = shared_family(name)
    rounds = speculative_generate_step(PROMPT, target, shared_family(name, quantize_bits=4),
                                       max_tokens=40, num_draft_tokens=3, prompt_lookup=False)
    got = [t for r in rounds for t in r.tokens]
    assert got == shared_plain_greedy(target, PROMPT, 40)
    session = rounds.session.target
    # each mixer re-run over the kept tokens (cache/replay.py; OLMo Hybrid's three
    # convolutions leave its Gated DeltaNet no recurrence-only path)
    assert session.rewind_path == ("model" if name in REWOUND_BY_THE_MODEL else "mixers")
    assert session.replayed_tokens > 0


@pytest.mark.parametrize("name", MORE_RECURRENT)
@pytest.mark.parametrize("rows", [1, 4])
def test_batched_rows_equal_their_own_greedy_decoding(name, rows):
    target = shared_family(name)
    if name in REWOUND_BY_THE_MODEL:
        assert not batchable(target)
        with pytest.raises(ValueError, match="one request at a time"):
            BatchEngine(target)
        return
    assert batchable(target)
    engine = BatchEngine(target, shared_family(name, quantize_bits=4), num_draft_tokens=3)
    got, drafted, accepted = decode_rows(
        engine, [RowRequest(p, NUM_TOKENS, prompt_lookup=False) for p in PROMPTS[:rows]])
    assert 0 < accepted < drafted  # rows rejected drafts, so their states went back
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == shared_plain_greedy(target, prompt, NUM_TOKENS)


def test_a_model_whose_logits_are_scaled_after_its_head_is_not_split():
    """Granite's logits are its head's divided by `logits_scaling`: no caller may take the head
    over the trunk's states for them (split_target refuses; the prompt look and the batched
    draft's catch-up fall back to the whole model). A batch with such a target and draft,
    lookup proposing too (so the draft catches up on several tokens at once), still gives
    every row its own greedy tokens."""
    from families import make_family, plain_greedy

    from mlx_spec.mtp.heads import split_target

    split_target(shared_family("granitemoehybrid"))  # unscaled: the split reproduces it
    target = make_family("granitemoehybrid")
    target.logits_scaling = 8.0
    with pytest.raises(TypeError, match="logits are not its output layer"):
        split_target(target)
    draft = make_family("granitemoehybrid", seed=5)
    draft.logits_scaling = 8.0
    engine = BatchEngine(target, draft, num_draft_tokens=3)
    assert engine.draft.split is None
    uids = [engine.insert(RowRequest(p, NUM_TOKENS, prompt_lookup=True)) for p in PROMPTS]
    got = {uid: [] for uid in uids}
    sources = set()
    while engine.busy:
        for out in engine.step():
            got[out.uid] += out.tokens
            sources.add(out.source)
    assert {"lookup", "draft"} <= sources
    for prompt, uid in zip(PROMPTS, uids):
        assert got[uid] == plain_greedy(target, prompt, NUM_TOKENS)


def test_a_recurrent_draft_that_never_read_anything_hands_back_its_cache():
    """A one-token prompt feeds the draft nothing, and a row that ends before its policy asks
    for drafts (its plain trial) never feeds it either: the cache it hands back (keep_cache)
    still holds its text (its draft's state from the tokens it had not seen), and a second
    turn on it gives the target's own tokens."""
    target = shared_family("mamba2")
    engine = BatchEngine(target, shared_family("mamba2", quantize_bits=4))
    engine.insert(RowRequest([7], 2, prompt_lookup=False, keep_cache=True))
    outputs = []
    while engine.busy:
        outputs += engine.step()
    assert outputs[-1].finish_reason == "length" and sum(o.num_drafted for o in outputs) == 0
    text = [7] + [t for o in outputs for t in o.tokens]
    second = text + [5, 9]
    engine.insert(RowRequest(second, 6, prompt_lookup=False), outputs[-1].cache,
                  cached=len(text))
    again = []
    while engine.busy:
        again += [t for o in engine.step() for t in o.tokens]
    assert again == shared_plain_greedy(target, second, 6)
