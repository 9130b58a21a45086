"""DFlash block drafters: the published layout loads, the drafter computes what the format
says (checked against a from-scratch forward), output is exact, bad input is one sentence."""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from dflash_tiny import dflash_config, make_dflash, write_dflash_dir
from families import plain_greedy, shared_family, shared_plain_greedy
from tiny import make_llama, shared_llama

from mlx_spec.acceptance import resample_from_target_accept
from mlx_spec.dflash import check_fits, load_dflash, parse_config, tapped
from mlx_spec.drafters import DFlashDrafter
from mlx_spec.exactness import check_exactness
from mlx_spec.generate import speculative_generate_step, stream_generate
from mlx_spec.sampling import SamplingConfig

PROMPT = [1, 2, 3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def llama_target():
    return make_llama(layers=4, seed=0)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return write_dflash_dir(tmp_path_factory.mktemp("dflash") / "d",
                            dflash_config(48, [1, 2], block_size=6))


def tokens_of(rounds):
    return [t for r in rounds for t in r.tokens]


# --- the published layout -------------------------------------------------------------

@pytest.mark.parametrize("generation", ["first", "current"])
def test_both_config_generations_parse(generation):
    config = parse_config(dflash_config(48, [1, 2], block_size=6, generation=generation))
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (6, 63, (1, 2))
    assert config.rope_theta == 10000.0 and config.head_dim == 12


def test_layer_types_set_windows_and_causality():
    config = parse_config(dflash_config(48, [1], layer_types=["sliding_attention",
                                                              "full_attention"],
                                        sliding_window=4))
    assert (config.window(0), config.window(1)) == (4, None)
    assert (config.causal(0), config.causal(1)) == (True, False)  # z-lab: sliding ones causal
    forced = parse_config(dflash_config(48, [1], is_causal=True))
    assert forced.causal(0) and forced.causal(1)


@pytest.mark.parametrize("edit, sentence", [
    (lambda c: c["dflash_config"].pop("mask_token_id"), "has no dflash_config.mask_token_id"),
    (lambda c: c.update(architectures=["DFlash2DraftModel"]),
     "is a DFlash2DraftModel and needs dflash_config.conv_kernel_size"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "is not a DFlash drafter"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[]), "needs dflash_config.target_layer_ids"),
    (lambda c: c.update(layer_types=["full_attention"]), "layer_types must list 2"),
    (lambda c: c.update(layer_types=["sliding_attention"] * 2), "no sliding_window > 0"),
    (lambda c: c["rope_parameters"].pop("rope_theta"), "gives no rope_theta"),
])
def test_a_config_it_cannot_use_is_one_sentence(edit, sentence):
    config = dflash_config(48, [1, 2])
    edit(config)
    with pytest.raises(ValueError, match=sentence):
        parse_config(config)


def test_weights_load_with_or_without_the_model_prefix(tmp_path):
    config = dflash_config(48, [1, 2])
    plain = load_dflash(write_dflash_dir(tmp_path / "a", config, seed=3))
    prefixed = load_dflash(write_dflash_dir(tmp_path / "b", config, seed=3, prefix="model."))
    for (name, a), (_, b) in zip(tree_flatten(plain.parameters()),
                                 tree_flatten(prefixed.parameters())):
        assert mx.array_equal(a, b), name


@pytest.mark.parametrize("case, sentence", [
    ("missing", "lacks layers.1.mlp.up_proj.weight"),
    ("unexpected", "holds an unexpected weight embed_tokens.weight"),
    ("shape", "weight fc.weight has shape \\(48, 48\\), the config says \\(48, 96\\)"),
])
def test_weights_not_in_the_layout_are_one_sentence(tmp_path, case, sentence):
    config = dflash_config(48, [1, 2])
    kwargs = {"missing": {"drop": ["layers.1.mlp.up_proj.weight"]},
              "unexpected": {"extra": {"embed_tokens.weight": mx.zeros((64, 48))}},
              "shape": {"extra": {"fc.weight": mx.zeros((48, 48))}}}[case]
    with pytest.raises(ValueError, match=sentence):
        load_dflash(write_dflash_dir(tmp_path / case, config, **kwargs))


@pytest.mark.parametrize("case, sentence", [
    ("hidden", "hidden size is 32 and the target's is 48"),
    ("taps", "taps target layer 4, and the target has 4 layers"),
    ("mask", "mask token 70 is outside the target's vocabulary"),
])
def test_a_drafter_for_another_target_is_refused(tmp_path, llama_target, case, sentence):
    kwargs = {"hidden": dict(hidden=32, taps=[1]), "taps": dict(hidden=48, taps=[1, 4]),
              "mask": dict(hidden=48, taps=[1], mask_token_id=70)}[case]
    drafter = make_dflash(tmp_path / case, **kwargs)
    with pytest.raises(ValueError, match=sentence):
        check_fits(drafter, llama_target)
    with pytest.raises(ValueError, match=sentence):  # the API says the same
        list(speculative_generate_step(PROMPT, llama_target, drafter, max_tokens=4))


# --- the taps --------------------------------------------------------------------------

def manual_layer_outputs(model, tokens):
    """Every decoder layer's output for `tokens`, by running the layers one by one."""
    from mlx_lm.models.base import create_attention_mask

    h = model.model.embed_tokens(mx.array([tokens]))
    mask = create_attention_mask(h, None)
    outputs = []
    for layer in model.model.layers:
        h = layer(h, mask, None)
        outputs.append(h[0])
    return outputs


def test_taps_are_the_chosen_layers_outputs_and_leave_the_model_as_it_was(llama_target):
    before = len(tree_flatten(llama_target.parameters()))
    with tapped(llama_target, [2, 0]) as outputs:
        logits = llama_target(mx.array([PROMPT]))
    expected = manual_layer_outputs(llama_target, PROMPT)
    for i in (0, 2):
        assert mx.allclose(outputs[i][0], expected[i], atol=1e-5)
    assert not mx.allclose(outputs[2][0], expected[3], atol=1e-3)  # not one layer off
    assert len(tree_flatten(llama_target.parameters())) == before
    assert mx.allclose(logits, llama_target(mx.array([PROMPT])), atol=1e-5)


# --- the drafter against a from-scratch forward -----------------------------------------

def rope(x, positions, theta):
    """NeoX-style rotary embedding of x (..., T, d) at the given absolute positions."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    angles = np.outer(positions, inv)  # (T, d/2)
    cos, sin = np.cos(angles), np.sin(angles)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def rms(x, w, eps=1e-6):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w


def from_scratch_block_rows(target, drafter, history, around=None, embed_scale=1.0):
    """The drafter's normed rows (B, H) for the block after `history`, computed densely in
    numpy: context = the target's taps at every position before the last token.
    `around(layer, kind, sublayer, h)` applies layer `layer`'s `kind` ("attention" or "mlp")
    sublayer to its normed input h (default: as is; DFlash2 wraps it in its convolutions)."""
    config = drafter.dflash_config
    W = {n: np.array(v, dtype=np.float64) for n, v in tree_flatten(drafter.parameters())}
    outputs = manual_layer_outputs(target, history[:-1])
    taps = np.concatenate([np.array(outputs[i]) for i in config.target_layer_ids], -1)
    ctx = rms(taps @ W["fc.weight"].T, W["hidden_norm.weight"])  # (c, H)
    c, B = ctx.shape[0], config.block_size
    block = [history[-1]] + [config.mask_token_id] * (B - 1)
    x = np.array(target.model.embed_tokens.weight, dtype=np.float64)[block] * embed_scale  # (B, H)
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    positions = np.arange(c + B)
    around = around or (lambda i, kind, sublayer, h: sublayer(h))
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."

        def attention(h):
            q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(B, heads, hd).transpose(1, 0, 2)
            q = rope(rms(q, W[p + "self_attn.q_norm.weight"]), positions[c:], config.rope_theta)
            rows = np.concatenate([ctx, h])  # keys and values: context rows (no layernorm), block
            keys = (rows @ W[p + "self_attn.k_proj.weight"].T).reshape(c + B, kv, hd)
            keys = rope(rms(keys.transpose(1, 0, 2), W[p + "self_attn.k_norm.weight"]), positions,
                        config.rope_theta)
            values = (rows @ W[p + "self_attn.v_proj.weight"].T).reshape(c + B, kv, hd)
            keys = np.repeat(keys, heads // kv, 0)
            values = np.repeat(values.transpose(1, 0, 2), heads // kv, 0)
            query_pos, key_pos = positions[c:, None], positions[None, :]
            visible = np.ones((B, c + B), bool)
            # z-lab's dflash/model.py: is_causal for all layers when the config says one, else
            # sliding layers causal; a window is p - j < W, and j - p < W when bidirectional
            sliding = config.layer_types[i] == "sliding_attention"
            causal = sliding if config.is_causal is None else config.is_causal
            if causal:
                visible &= key_pos <= query_pos
            if sliding:
                visible &= query_pos - key_pos < config.sliding_window
                if not causal:
                    visible &= key_pos - query_pos < config.sliding_window
            scores = np.where(visible, q @ keys.transpose(0, 2, 1) / np.sqrt(hd), -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            attn = (weights @ values).transpose(1, 0, 2).reshape(B, heads * hd)
            return attn @ W[p + "self_attn.o_proj.weight"].T

        def mlp(h):
            gate, up = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
            return (gate / (1 + np.exp(-gate)) * up) @ W[p + "mlp.down_proj.weight"].T

        x = x + around(i, "attention", attention, rms(x, W[p + "input_layernorm.weight"]))
        x = x + around(i, "mlp", mlp, rms(x, W[p + "post_attention_layernorm.weight"]))
    return rms(x, W["norm.weight"])


def from_scratch_block_logits(target, drafter, history, k):
    """The drafter's logits (k, V) for the block after `history` (see from_scratch_block_rows)."""
    rows = from_scratch_block_rows(target, drafter, history)
    return rows[1:k + 1] @ np.array(target.lm_head.weight, dtype=np.float64).T  # (k, V)


class Recording(DFlashDrafter):
    """The drafter, noting each proposal's history and q."""

    proposals = []

    def propose(self, history, k):
        proposal = super().propose(history, k)
        if proposal is not None:
            Recording.proposals.append((list(history), k, proposal.probs))
        return proposal


@pytest.mark.parametrize("layout", ["full", "sliding", "causal", "sliding-bidirectional"])
def test_each_block_equals_a_from_scratch_forward_over_the_kept_context(
        tmp_path, llama_target, monkeypatch, layout):
    """Over real rounds with rejections: every block's q equals a dense forward whose context
    is the target's taps at every kept position (a tap, position or context off by one fails)."""
    from mlx_spec import assemble

    sliding = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    kwargs = {"full": {}, "sliding": sliding, "causal": dict(is_causal=True),
              "sliding-bidirectional": dict(sliding, sliding_window=2, is_causal=False)}[layout]
    drafter = make_dflash(tmp_path / layout, 48, [1, 3], block_size=5, **kwargs)
    monkeypatch.setattr(assemble, "DFlashDrafter", Recording)
    Recording.proposals = []
    mx.random.seed(3)
    sampling = SamplingConfig(temp=1.0)
    tokens = 60 if layout.startswith("sliding") else 24  # well past the window
    rounds = list(speculative_generate_step(PROMPT, llama_target, drafter, max_tokens=tokens,
                                            num_draft_tokens=3, sampling=sampling,
                                            prompt_lookup=False, calibration=None))
    assert any(r.num_drafted > r.num_accepted for r in rounds[:-1])  # rejections happened
    assert len(Recording.proposals) >= 4
    for history, k, probs in Recording.proposals:
        logits = from_scratch_block_logits(llama_target, drafter, history, k)
        expected = np.exp(logits - logits.max(-1, keepdims=True))
        expected /= expected.sum(-1, keepdims=True)
        assert np.allclose(np.array(probs), expected, atol=2e-4), (layout, len(history))


# --- exactness ---------------------------------------------------------------------------

FAMILY_CASES = [("llama", None), ("llama", 1), ("llama", 3), ("llama", 9),
                ("qwen3_5", None), ("qwen3_5", 3), ("gemma3_text", 4), ("gpt_oss", None),
                ("qwen3_5-q4", 3), ("nemotron_h", 2)]


@pytest.mark.parametrize("family, k", FAMILY_CASES)
def test_greedy_output_is_the_targets_own(tmp_path, family, k):
    """Plain, hybrid (Gated DeltaNet, Mamba-2), sliding-window and quantized targets."""
    if family == "llama":
        target, hidden = shared_llama(layers=4, seed=2), 48
    else:
        name, _, quant = family.partition("-q")
        target = shared_family(name, seed=2, quantize_bits=int(quant) if quant else None)
        hidden = 32
    drafter = make_dflash(tmp_path / "d", hidden, [0, 2], block_size=6, seed=5,
                          layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    expected = shared_plain_greedy(target, PROMPT, 100)
    rounds = list(speculative_generate_step(PROMPT, target, drafter, max_tokens=100,
                                            num_draft_tokens=k, calibration=None))
    assert tokens_of(rounds) == expected
    dflash = [r for r in rounds if r.source == "dflash"]
    assert dflash, "the drafter proposed nothing"
    if k is not None:  # exactly k (at most the block's 5) wherever max_tokens leaves room
        emitted = 0
        for r in rounds:
            if r.source == "dflash":
                assert r.num_drafted == min(k, 5, 100 - emitted)
            emitted += len(r.tokens)


def test_lookup_in_front_of_the_drafter_stays_exact(tmp_path, llama_target):
    drafter = make_dflash(tmp_path / "d", 48, [1, 2], block_size=6)
    prompt = PROMPT * 3  # something to look up
    expected = plain_greedy(llama_target, prompt, 60)
    rounds = list(speculative_generate_step(prompt, llama_target, drafter, max_tokens=60,
                                            prompt_lookup=True, calibration=None))
    assert tokens_of(rounds) == expected
    assert {"dflash"} <= {r.source for r in rounds}


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """A target over 8 tokens and a random drafter: q overlaps p, so rejections bias a broken
    rule visibly."""
    target = make_llama(vocab_size=8, layers=4, seed=0)
    drafter = make_dflash(tmp_path_factory.mktemp("dflash8") / "d", 48, [1, 2], block_size=6,
                          mask_token_id=7)
    return target, drafter


def sampled_exactness(pair, k, accept=None, samples=800):
    """check_exactness at temp 1 for a (target, drafter) pair: `samples` samples of the first
    two tokens, k drafts per round. 800 here: the broken rule's noncentrality is ~96 on 16 dof
    (missed with probability ~4e-6; at 400 it would be ~4e-2)."""
    target, drafter = pair
    return check_exactness(target, drafter, PROMPT, SamplingConfig(temp=1.0), samples=samples,
                           num_draft_tokens=k, seed=0, accept=accept)


@pytest.mark.parametrize("k", [1, 3])
def test_sampling_matches_the_targets_distribution(small_vocab_pair, k):
    """k = 1: the second token comes from the second round, after the first one's rejection
    or acceptance; k = 3: from inside the first block."""
    result = sampled_exactness(small_vocab_pair, k)
    assert result.acceptance_rate > 0.2 and result.passed, result


def test_the_chi_square_catches_a_broken_rule(small_vocab_pair):
    result = sampled_exactness(small_vocab_pair, 1, accept=resample_from_target_accept)
    assert not result.passed, result


# --- where a draft is accepted, a DFlash drafter works --------------------------------

def check_the_api_and_the_command_line_take(model_dirs, path):
    """Text generated with the drafter directory at `path` (stream_generate, mlx-spec generate
    --draft-model) equals the target's alone, and the drafter drafted."""
    from mlx_spec import load
    from mlx_spec.cli import main

    target, tokenizer = load(str(model_dirs["target"]))
    plain = "".join(r.text for r in stream_generate(target, tokenizer, "def f(x):",
                                                    max_tokens=30))
    responses = list(stream_generate(target, tokenizer, "def f(x):", draft_model=str(path),
                                     max_tokens=30, prompt_lookup=False))
    assert "".join(r.text for r in responses) == plain
    assert responses[-1].stats.rounds > 0 and responses[-1].stats.drafted > 0
    args = ["generate", "--model", str(model_dirs["target"]), "--prompt", "def f(x):",
            "--max-tokens", "20", "--no-prompt-lookup", "--ignore-chat-template", "-q"]
    no_draft = CliRunner().invoke(main, args + ["--no-draft"])
    spec = CliRunner().invoke(main, args + ["--draft-model", str(path)])
    assert no_draft.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == no_draft.stdout


def target_vocab(model_dirs) -> int:
    return json.loads((model_dirs["target"] / "config.json").read_text())["vocab_size"]


def test_the_api_and_the_command_line_take_the_drafters_directory(model_dirs, tmp_path):
    config = dflash_config(48, [0, 1], mask_token_id=target_vocab(model_dirs) - 1)
    check_the_api_and_the_command_line_take(model_dirs, write_dflash_dir(tmp_path / "d", config))


def test_the_command_line_refuses_a_drafter_for_another_target(model_dirs, tmp_path):
    from mlx_spec.cli import main

    path = write_dflash_dir(tmp_path / "d", dflash_config(32, [0], mask_token_id=1))
    result = CliRunner().invoke(main, ["generate", "--model", str(model_dirs["target"]),
                                       "--draft-model", str(path), "--max-tokens", "4"])
    assert result.exit_code == 2
    assert "The DFlash drafter's hidden size is 32 and the target's is 48" in result.output
    assert "Traceback" not in result.output
