"""mlx-lm's `kv_bits` while speculating (cache/quantize.py): the target's attention layers are
quantized at the token where mlx-lm's generate_step quantizes them (after the forward that
brings the cache to `quantized_kv_start` tokens), and no verify pass reaches past that point,
so every position attends the keys and values mlx-lm's own decoding gives it: the same greedy
tokens as mlx-lm's generate_step with the same arguments (many k, drafts and lookup, the point
in the prompt or in the reply), the same distribution at T = 1 on tokens after a
mid-generation rejection across the point (against one computed with mlx-lm's own
maybe_quantize_kv_cache). The controls must fail: rounds that reach past the point, and
resampling a rejection from p.
"""

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from families import settled
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from tiny import make_llama

from mlx_spec.acceptance import resample_from_target_accept
from mlx_spec.cache import quantize
from mlx_spec.cli import main
from mlx_spec.exactness import chi_square
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig, logprobs_from_logits

PROMPT = [5, 17, 3, 40, 9, 5, 17, 3]
N = 40
GROUP = 32  # the tiny models' keys are 32 wide (hidden 64, 2 heads)


@pytest.fixture(scope="module")
def pair():
    """A target and a related draft (its weights scaled a little otherwise: some drafts kept,
    some rejected)."""
    return (make_llama(vocab_size=64, hidden=64, heads=2, seed=0),
            make_llama(vocab_size=64, hidden=64, heads=2, seed=0, weight_scale=2.9))


def mlx_lm_greedy(model, prompt, n, bits, start, step=4):
    return [int(t) for t, _ in generate_step(
        mx.array(prompt), model, max_tokens=n, sampler=lambda lp: mx.argmax(lp, axis=-1),
        kv_bits=bits, kv_group_size=GROUP, quantized_kv_start=start, prefill_step_size=step)]


def ours(target, draft, prompt, n, bits, start, **kwargs):
    """(the tokens, the rounds, the target's layers after them)."""
    stream = speculative_generate_step(prompt, target, draft, max_tokens=n, kv_bits=bits,
                                       kv_group_size=GROUP, quantized_kv_start=start,
                                       prefill_step_size=4, calibration=None, **kwargs)
    rounds = list(stream)
    return [t for r in rounds for t in r.tokens], rounds, stream.session.target.layers


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("start", [3, 12, 20])  # in the prompt's prefill; in the reply
def test_greedy_tokens_are_mlx_lms_with_kv_bits(pair, bits, start):
    target, draft = pair
    expected = mlx_lm_greedy(target, PROMPT, N, bits, start)
    assert expected != mlx_lm_greedy(target, PROMPT, N, None, 0)  # the quantization shows
    for k in (1, 3, 5, None):  # None: the policy's k
        for lookup in (False, None):  # None: prompt lookup in front of the draft (default)
            got, _, layers = ours(target, draft, PROMPT, N, bits, start, num_draft_tokens=k,
                                  prompt_lookup=lookup)
            assert got == expected, (k, lookup)
            assert all(type(layer) is QuantizedKVCache for layer in layers)


@pytest.mark.parametrize("start", [3, 12])
def test_token_trees_on_the_quantized_cache(pair, start):
    """Trees of two shapes (their depth stops at the point as a chain does), each round's
    accepted path gathered in the quantized layers (as mlx-lm's to_quantized leaves them: lists
    of packed arrays, scales and biases)."""
    target, draft = pair
    expected = mlx_lm_greedy(target, PROMPT, N, 2, start)
    for tree in ((3, 2), (2, 3)):
        for lookup in (False, True):
            got, rounds, _ = ours(target, draft, PROMPT, N, 2, start, num_draft_tokens=3,
                                  tree=tree, prompt_lookup=lookup)
            assert got == expected, (tree, lookup)
            assert any(r.tree_nodes > r.num_drafted for r in rounds)  # trees, not chains


def test_decoding_alone_and_with_lookup_alone(pair):
    target, _ = pair
    expected = mlx_lm_greedy(target, PROMPT, N, 4, 12)
    assert ours(target, None, PROMPT, N, 4, 12, prompt_lookup=False)[0] == expected
    assert ours(target, None, PROMPT * 3, N, 4, 30, prompt_lookup=True)[0] == \
        mlx_lm_greedy(target, PROMPT * 3, N, 4, 30)


def test_the_control_rounds_past_the_point_change_the_text(pair, monkeypatch):
    """Rounds allowed to reach past the token where the cache is quantized (positions after it
    attend full-precision keys) give other text than mlx-lm's."""
    target, draft = pair
    monkeypatch.setattr(quantize.KVQuantizer, "room", lambda self: None)
    expected = mlx_lm_greedy(target, PROMPT, N, 2, 12)
    got = [ours(target, draft, PROMPT, N, 2, 12, num_draft_tokens=k, prompt_lookup=False)[0]
           for k in (3, 5)]
    assert all(tokens != expected for tokens in got)


@pytest.mark.parametrize("bits,start", [(4, 12), (2, 8 + 20), (2, 8 + 20 - 1), (2, 8 + 20 + 1)])
def test_a_reused_prompt_cache_holds_the_quantized_layers_and_a_second_turn_is_mlx_lms(bits,
                                                                                       start):
    """The shipped pair (keys 64 wide), two turns on one prompt cache, against mlx-lm's
    generate_step on its own: the point in the first reply, and at its last tokens (where the
    call's own end must quantize the cache it leaves, as mlx-lm's last forward does)."""
    from mlx_spec import load_default_pair, stream_generate

    target, draft, tokenizer = load_default_pair()
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    first = [r.token for r in stream_generate(target, tokenizer, PROMPT, draft_model=draft,
                                              max_tokens=20, prompt_cache=cache, kv_bits=bits,
                                              kv_group_size=GROUP, quantized_kv_start=start)]
    n = len(target.layers)
    quantized = len(PROMPT) + len(first) >= start
    assert all(type(layer) is (QuantizedKVCache if quantized else KVCache)
               for layer in cache[:n])
    assert all(type(layer) is KVCache for layer in cache[n:])  # the draft's stay as they are
    second_prompt = tokenizer.encode("\n\ndef main():")
    second = [r.token for r in stream_generate(target, tokenizer, second_prompt,
                                               draft_model=draft, max_tokens=20,
                                               prompt_cache=cache, kv_bits=bits,
                                               kv_group_size=GROUP, quantized_kv_start=start)]
    reference = make_prompt_cache(target)
    expected = []
    for prompt in (PROMPT, second_prompt):
        expected.append([int(t) for t, _ in generate_step(
            mx.array(prompt), target, max_tokens=20, prompt_cache=reference,
            sampler=lambda lp: mx.argmax(lp, axis=-1), kv_bits=bits, kv_group_size=GROUP,
            quantized_kv_start=start)])
    assert first == expected[0]
    assert second == expected[1]


def test_a_group_size_that_does_not_divide_the_keys_is_one_sentence():
    target = make_llama(vocab_size=64)  # keys 12 wide
    with pytest.raises(ValueError, match="are 12 wide, which kv_group_size 32 does not divide: "
                                         "pass no kv_bits"):
        speculative_generate_step(PROMPT, target, None, kv_bits=4, kv_group_size=32)
    wide = make_llama(vocab_size=64, hidden=64, heads=2)  # keys 32 wide
    with pytest.raises(ValueError, match="which kv_group_size 64 does not divide: pass "
                                         "kv_group_size=32"):
        speculative_generate_step(PROMPT, wide, None, kv_bits=4, kv_group_size=64)
    with pytest.raises(ValueError, match="max_kv_size makes every layer a sliding window"):
        speculative_generate_step(PROMPT, wide, None, kv_bits=4, kv_group_size=32,
                                  max_kv_size=16)
    with pytest.raises(ValueError, match="kv_bits must be None or one of 2, 3, 4, 5, 6, 8"):
        speculative_generate_step(PROMPT, target, None, kv_bits=7)
    with pytest.raises(ValueError, match="kv_group_size must be one of 32, 64, 128"):
        speculative_generate_step(PROMPT, target, None, kv_bits=4, kv_group_size=48)


def test_the_command_line_takes_mlx_lms_options():
    result = CliRunner().invoke(main, ["generate", "-n", "24", "-q", "--kv-bits", "4",
                                       "--kv-group-size", "32", "--quantized-kv-start", "8"])
    assert result.exit_code == 0, result.output
    plain = CliRunner().invoke(main, ["generate", "-n", "24", "-q", "--kv-bits", "4",
                                      "--kv-group-size", "32", "--quantized-kv-start", "8",
                                      "--no-draft", "--no-prompt-lookup"])
    assert result.stdout == plain.stdout  # speculation does not change the quantized text
    bad = CliRunner().invoke(main, ["generate", "-n", "4", "--kv-bits", "4",
                                    "--kv-group-size", "128"])
    assert bad.exit_code == 2 and "kv_group_size 128 does not divide" in bad.output


# --- T = 1: tokens 3 and 4, after a rejection, across the point -----------------------------
#
# An 8-token vocabulary, the prompt [3, 1, 4] and the cache quantized at 4 tokens: tokens 1
# and 2 come from positions 2 and 3 (full precision: the first round may draft one token, not
# the two asked), tokens 3 and 4 from positions 4 and 5 on the quantized cache, after the
# first round rejected its draft in most samples. The exact distribution of (t3, t4): every
# prefix (t1, t2, t3) decoded by the target with mlx-lm's own maybe_quantize_kv_cache.

MID_PROMPT = [3, 1, 4]
START = 4
SAMPLES = 600


def exact_third_and_fourth(target, sampling, bits):
    prefixes = np.array([(a, b, c) for a in range(8) for b in range(8) for c in range(8)])
    rows = prefixes.shape[0]
    cache = make_prompt_cache(target)
    target(mx.array([MID_PROMPT[:-1]] * rows), cache=cache)
    maybe_quantize_kv_cache(cache, START, GROUP, bits)
    columns = [np.full(rows, MID_PROMPT[-1])] + [prefixes[:, i] for i in range(3)]
    probs = []
    for column in columns:  # positions 2..5, one step each, quantized as mlx-lm quantizes
        logits = target(mx.array(column[:, None]), cache=cache)[:, -1]
        maybe_quantize_kv_cache(cache, START, GROUP, bits)
        probs.append(np.array(mx.exp(logprobs_from_logits(logits, sampling)), np.float64))
    exact = {}
    for row, (a, b, c) in enumerate(prefixes):
        chance = probs[0][row, a] * probs[1][row, b] * probs[2][row, c]
        for d in range(8):
            exact[(c, d)] = exact.get((c, d), 0.0) + chance * probs[3][row, d]
    return exact


@pytest.mark.parametrize("accept,exact", [(None, True), (resample_from_target_accept, False)],
                         ids=["exact-rule", "negative-control"])
def test_tokens_after_a_rejection_across_the_point_match_the_target(accept, exact):
    target = make_llama(vocab_size=8, hidden=64, heads=2, seed=0)
    draft = make_llama(vocab_size=8, seed=7, hidden=32, layers=1)
    sampling = SamplingConfig(temp=1.0)
    mx.random.seed(0)
    counts, rewound, first_drafts = {}, 0, set()
    for _ in range(SAMPLES):
        out, early = [], False
        for i, round_ in enumerate(speculative_generate_step(
                MID_PROMPT, target, draft, max_tokens=4, num_draft_tokens=2, sampling=sampling,
                accept=accept, prompt_lookup=False, kv_bits=4, kv_group_size=GROUP,
                quantized_kv_start=START, calibration=None)):
            if i == 0:
                first_drafts.add(round_.num_drafted)
            if round_.num_accepted < round_.num_drafted and len(out) + len(round_.tokens) < 3:
                early = True
            out += round_.tokens
        rewound += early
        counts[tuple(out[2:4])] = counts.get(tuple(out[2:4]), 0) + 1
    assert first_drafts == {1}  # the first round stops at the point: one draft, not two
    assert rewound > SAMPLES // 3, rewound
    _, _, p_value = chi_square(counts, exact_third_and_fourth(target, sampling, 4))
    assert (p_value > 1e-3) == exact, p_value


# --- a hybrid target and a sliding-window one -------------------------------------------------

def _qwen3_5():
    """A Gated DeltaNet hybrid (ArraysCache beside KVCache layers), keys 32 wide."""
    from mlx_lm.models import qwen3_5

    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({
        "model_type": "qwen3_5", "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "linear_num_value_heads": 2,
        "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "vocab_size": 64,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25}}))
    return settled(model)


def _gemma3_text():
    """Sliding windows (layers 0, 1, 3) and a global layer (2), keys 32 wide."""
    from mlx_lm.models import gemma3_text

    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict({
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-6, "vocab_size": 64,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window": 8,
        "sliding_window_pattern": 3, "max_position_embeddings": 4096}))
    return settled(model)


def test_a_hybrid_target_is_mlx_lms_with_kv_bits():
    """Qwen3.5's attention layers quantized, its recurrent state left as mlx-lm leaves it;
    drafted by its own weights at 4 bits (rounds rewind its state)."""
    import mlx.nn as nn

    target, draft = _qwen3_5(), _qwen3_5()
    nn.quantize(draft, group_size=32, bits=4,
                class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 32 == 0)
    expected = mlx_lm_greedy(target, PROMPT, N, 2, 12)
    assert expected != mlx_lm_greedy(target, PROMPT, N, None, 0)
    for k in (2, 4):
        got, rounds, _ = ours(target, draft, PROMPT, N, 2, 12, num_draft_tokens=k,
                              prompt_lookup=False)
        assert got == expected, k
        assert 0 < sum(r.num_accepted for r in rounds) < sum(r.num_drafted for r in rounds)


def test_sliding_windows_stay_and_the_global_layers_are_quantized():
    """mlx-lm cannot quantize a RotatingKVCache (NotImplementedError); here its global layers
    are quantized and its windows stay, and speculating gives the text this target decodes
    alone with the same kv_bits."""
    target = _gemma3_text()
    draft = _gemma3_text()
    draft.update(tree_map(lambda w: w * 0.97 if w.ndim >= 2 else w, draft.parameters()))
    alone, _, layers = ours(target, None, PROMPT, N, 2, 12, prompt_lookup=False)
    kinds = [type(layer).__name__ for layer in layers]
    assert kinds[2] == "QuantizedKVCache" and kinds.count("QuantizedKVCache") == 1
    assert alone != ours(target, None, PROMPT, N, None, 0, prompt_lookup=False)[0]
    for k in (2, 4):
        got, rounds, _ = ours(target, draft, PROMPT, N, 2, 12, num_draft_tokens=k)
        assert got == alone, k
        assert 0 < sum(r.num_accepted for r in rounds) < sum(r.num_drafted for r in rounds)


def test_the_shipped_targets_drafters_give_mlx_lms_text():
    """The draft model, the target's MTP head and its DFlash drafter, each reading the target's
    hidden states from passes over the quantized cache: mlx-lm's greedy text."""
    from mlx_spec import load_default_pair

    target, draft, tokenizer = load_default_pair()
    prompt = tokenizer.encode("import os\n\ndef main():")
    expected = [int(t) for t, _ in generate_step(
        mx.array(prompt), target, max_tokens=40, sampler=lambda lp: mx.argmax(lp, axis=-1),
        kv_bits=4, kv_group_size=64, quantized_kv_start=10)]
    for drafter in (draft, "mtp", "dflash"):
        rounds = list(speculative_generate_step(prompt, target, drafter, max_tokens=40, kv_bits=4,
                                                quantized_kv_start=10, calibration=None))
        assert [t for r in rounds for t in r.tokens] == expected, drafter
        assert sum(r.num_accepted for r in rounds) > 0


@pytest.mark.real_model
@pytest.mark.parametrize("start", [8, 40])  # in the prompt; in the reply
def test_a_real_model_with_kv_bits_speculates_to_mlx_lms_text(start):
    """SmolLM2 (GGUF, Q4_1; keys 64 wide) with 4-bit KV caches, prompt lookup proposing on a
    copying prompt: mlx-lm's greedy text."""
    from gguf_files import real_model_path

    from mlx_spec import load

    path = real_model_path("SmolLM2-135M-Instruct.Q4_1.gguf")
    if path is None:
        pytest.skip("SmolLM2 is not downloaded (make real-models)")
    target, tokenizer = load(str(path))
    prompt = tokenizer.encode("Copy: the keeper wrote the wind in his book every night. "
                              "Copy: the keeper wrote")
    expected = [int(t) for t, _ in generate_step(
        mx.array(prompt), target, max_tokens=16, sampler=lambda lp: mx.argmax(lp, axis=-1),
        kv_bits=4, kv_group_size=64, quantized_kv_start=start)]
    rounds = list(speculative_generate_step(prompt, target, None, max_tokens=16, kv_bits=4,
                                            kv_group_size=64, quantized_kv_start=start,
                                            prefill_step_size=2048, calibration=None))
    assert [t for r in rounds for t in r.tokens] == expected
    assert any(r.source == "lookup" and r.num_accepted for r in rounds)
