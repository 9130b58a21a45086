"""EAGLE-3 heads in the three published layouts, drafting exactly.

Tiny random heads are written by the tests in each layout, config keys and tensor names as
published (SafeAILab/EAGLE's `LlamaForCausalLMEagle3` config with `midlayer.*`; speculators'
`Eagle3Speculator` with `layers.0.*`, `transformer_layer_config`,
`eagle_aux_hidden_state_layer_ids`, `norm_before_fc`; SpecForge's `eagle_config`), for tiny
llama targets (mlx-lm's class, 8 layers: the default taps are hidden_states[2], [4], [5]) and a
sliding-window gemma3_text target. The draft vocabulary is a shuffled subset of the target's
(d2t non-trivial offsets, t2d its mask).

- loading: each layout reads back the weights written; the three layouts of the same weights
  draft the same; bad heads are one sentence;
- the head's logits at every draft step of a generation (random acceptance: every rewind) equal
  a from-scratch forward written here over the whole kept context, with the taps read from
  Hugging Face's hidden_states list; a tap one layer off, or a chained step's position not
  advanced, must differ (negative controls);
- greedy parity over 120 tokens for several k;
- chi-square at T = 1 of the first two tokens, and of tokens 3 and 4 after a mid-generation
  rejection; q taken before the vocabulary mapping must fail (negative control).
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from families import make_family, plain_greedy
from tiny import make_llama

from mlx_spec.acceptance import speculative_accept
from mlx_spec.drafters.eagle3 import Eagle3Drafter
from mlx_spec.drafters.head_chain import feed
from mlx_spec.drafters.protocol import Proposal
from mlx_spec.eagle3 import Eagle3Head, eagle3_directory, load_eagle3, parse_config
from mlx_spec.eagle3.config import ORIGINAL, SPECFORGE, SPECULATORS
from mlx_spec.exactness import chi_square, check_exactness
from mlx_spec.generate import speculative_generate_step
from mlx_spec.mtp.heads import text_model
from mlx_spec.sampling import SamplingConfig, logprobs_from_logits, sample

LAYERS = 8
PROMPT = [5, 9, 14, 3, 27, 8, 41, 3, 27]
LAYOUTS = [ORIGINAL, SPECULATORS, SPECFORGE]


# --- writing heads as published --------------------------------------------------------

def layer_config(target, hidden, kv_heads=2):
    args = text_model(target).args
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_attention_heads": 4, "num_key_value_heads": kv_heads, "num_hidden_layers": 1,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
            "hidden_act": "silu", "vocab_size": args.vocab_size, "tie_word_embeddings": False}


def head_tensors(target, draft_vocab, seed, own_embedding=False, norm_before_fc=False,
                 scale=3.0):
    """Random head tensors named as EAGLE writes them (`midlayer.*`), d2t/t2d included."""
    args = text_model(target).args
    hidden, vocab = args.hidden_size, args.vocab_size
    config = parse_config({**layer_config(target, hidden), "architectures":
                           ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
                           "norm_before_fc": norm_before_fc}, "test")
    mx.random.seed(seed)
    head = Eagle3Head(config, own_embedding=own_embedding)
    head.update(tree_map(lambda w: w * scale if w.ndim == 2 else w, head.parameters()))
    tensors = dict(tree_flatten(head.parameters()))
    if norm_before_fc:  # not all ones: a norm left out shows
        tensors["input_norm.weight"] = 1 + 0.5 * mx.random.normal((3 * hidden,))
    tensors["midlayer.hidden_norm.weight"] = 1 + 0.5 * mx.random.normal((hidden,))
    rng = np.random.default_rng(seed)
    targets = np.sort(rng.choice(vocab, draft_vocab, replace=False))
    tensors["d2t"] = mx.array(targets - np.arange(draft_vocab), mx.int64)
    mask = np.zeros(vocab, bool)
    mask[targets] = True
    tensors["t2d"] = mx.array(mask)
    return tensors


def write_head(path, layout, target, tensors, ids=None, **flags):
    """A head directory in `layout`; `ids`: the tap layers in that layout's own convention."""
    path.mkdir(parents=True, exist_ok=True)
    hidden = text_model(target).args.hidden_size
    draft_vocab = tensors["lm_head.weight"].shape[0]
    kv_heads = tensors["midlayer.self_attn.k_proj.weight"].shape[0] // (hidden // 4)
    layer = layer_config(target, hidden, kv_heads)
    if layout == SPECULATORS:
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_version": "0.1.0", "draft_vocab_size": draft_vocab,
                  "transformer_layer_config": layer,
                  "norm_before_residual": flags.get("norm_before_residual", False),
                  "norm_before_fc": flags.get("norm_before_fc", False),
                  "target_hidden_size": None,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method":
                                         "greedy", "proposal_methods": [
                                             {"proposal_type": "greedy",
                                              "speculative_tokens": 3}],
                                         "verifier": {"name_or_path": "tiny/llama",
                                                      "architectures": ["LlamaForCausalLM"]}}}
        if ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = list(ids)
        tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    else:
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"],
                  "draft_vocab_size": draft_vocab}
        if layout == SPECFORGE:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids),
                                      "use_aux_hidden_state": True}
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), tensors)
    return path


QUIET = ("o_proj.weight", "down_proj.weight")  # a target layer's outputs


def near_bigram(target, eps=0.03):
    """The target with its layers' outputs scaled down: its next token follows mostly from the
    current one (lm_head(norm(e(x))))."""
    quiet = [(name, w * eps) for name, w in tree_flatten(target.parameters())
             if name.startswith("model.layers.") and name.endswith(QUIET)]
    target.load_weights(quiet, strict=False)
    mx.eval(target.parameters())
    return target


def good_head_tensors(target, draft_vocab, seed, noise=0.0):
    """A head made by hand to draft the near-bigram target's next token: each query attends to
    its own key (q = k = the normed embedding, scaled up), whose value is that embedding, so
    g is about e(x_{i+1}) and lm_head(norm(g)) is the target's own bigram row, over the draft
    vocabulary; `noise` (relative) on lm_head makes it worse."""
    tensors = head_tensors(target, draft_vocab, seed)
    hidden = text_model(target).args.hidden_size
    eye = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)  # reads e
    for name in ("q_proj", "k_proj"):
        tensors[f"midlayer.self_attn.{name}.weight"] = 3.0 * eye
    tensors["midlayer.self_attn.v_proj.weight"] = eye
    tensors["midlayer.self_attn.o_proj.weight"] = 5.0 * mx.eye(hidden)
    tensors["fc.weight"] = tensors["fc.weight"] * 0.01
    tensors["midlayer.mlp.down_proj.weight"] = mx.zeros_like(
        tensors["midlayer.mlp.down_proj.weight"])
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{norm}.weight"] = mx.ones((hidden,))
    targets = mx.arange(draft_vocab) + tensors["d2t"]
    rows = target.lm_head.weight[targets]
    if noise:
        rows = rows + noise * mx.std(rows) * mx.random.normal(rows.shape)
    tensors["lm_head.weight"] = rows
    tensors["norm.weight"] = target.model.norm.weight
    return tensors


@pytest.fixture(scope="module")
def bigram():
    """A near-bigram llama and a hand-made head that drafts it well (partial acceptance)."""
    return near_bigram(make_llama(vocab_size=64, hidden=48, layers=LAYERS, seed=0))


@pytest.fixture(scope="module")
def llama():
    return make_llama(vocab_size=64, hidden=48, layers=LAYERS, seed=0)


# the default taps: hidden_states[2], [L // 2], [L - 3] = outputs of layers 1, 3, 4
DEFAULT_IDS = {ORIGINAL: None, SPECULATORS: [2, LAYERS // 2, LAYERS - 3],
               SPECFORGE: [1, LAYERS // 2 - 1, LAYERS - 4]}


@pytest.fixture(scope="module")
def heads(tmp_path_factory, llama):
    """{layout: directory} of the same weights, and a speculators head with every flag on."""
    root = tmp_path_factory.mktemp("eagle3")
    tensors = head_tensors(llama, 48, seed=1)
    dirs = {layout: write_head(root / layout, layout, llama, tensors, DEFAULT_IDS[layout])
            for layout in LAYOUTS}
    flagged = head_tensors(llama, 40, seed=2, own_embedding=True, norm_before_fc=True)
    dirs["flags"] = write_head(root / "flags", SPECULATORS, llama, flagged, [3, 5, 8],
                               norm_before_residual=True, norm_before_fc=True)
    return dirs


# --- from scratch ------------------------------------------------------------------------

def hidden_states_list(target, tokens):
    """Hugging Face's output_hidden_states: [embeddings, output of layer 0, 1, ...] (T, H)."""
    inner = target.model
    h = inner.embed_tokens(mx.array(tokens)[None])
    states = [h[0]]
    for layer in inner.layers:
        h = layer(h, mask="causal", cache=None)
        states.append(h[0])
    return states


def rms(x, w, eps=1e-6):
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta=10000.0):
    """Hugging Face's rotate_half RoPE: x (heads, T, D) at `positions`."""
    d = x.shape[-1]
    freqs = theta ** (-mx.arange(0, d, 2, dtype=mx.float32) / d)
    angles = mx.array(positions, mx.float32)[:, None] * freqs[None]  # (T, D/2)
    cos, sin = mx.cos(mx.concatenate([angles] * 2, -1)), mx.sin(mx.concatenate([angles] * 2, -1))
    half = d // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Scratch:
    """The head's maths written out from the published code, over named tensors."""

    def __init__(self, path, hs_ids, flags=(), chained_position_step=1):
        self.w = {k.replace("layers.0.", "midlayer."): v
                  for k, v in mx.load(str(path / "model.safetensors")).items()}
        self.hs_ids = hs_ids  # indices into hidden_states_list
        self.flags = set(flags)
        self.step = chained_position_step

    def lin(self, name, x):
        return x @ self.w[name + ".weight"].T

    def layer(self, e, f, positions, keys, values):
        """One midlayer pass over new rows; keys/values: the earlier (heads, S, D) or None."""
        w, m = self.w, "midlayer."
        normed = rms(f, w[m + "hidden_norm.weight"])
        residual = normed if "norm_before_residual" in self.flags else f
        a = mx.concatenate([rms(e, w[m + "input_layernorm.weight"]), normed], -1)  # (T, 2H)
        T, width = a.shape[0], f.shape[-1] // 4  # 4 query heads
        q = self.lin(m + "self_attn.q_proj", a).reshape(T, 4, -1).transpose(1, 0, 2)
        k = self.lin(m + "self_attn.k_proj", a).reshape(T, -1, width).transpose(1, 0, 2)
        v = self.lin(m + "self_attn.v_proj", a).reshape(T, -1, width).transpose(1, 0, 2)
        q, k = rope(q, positions), rope(k, positions)
        if keys is not None:
            k, v = mx.concatenate([keys, k], 1), mx.concatenate([values, v], 1)
        S = k.shape[1]
        kk, vv = mx.repeat(k, 4 // k.shape[0], axis=0), mx.repeat(v, 4 // v.shape[0], axis=0)
        scores = (q @ kk.transpose(0, 2, 1)) / (q.shape[-1] ** 0.5)  # (4, T, S)
        visible = mx.arange(S)[None] <= (S - T + mx.arange(T))[:, None]
        scores = mx.where(visible, scores, -mx.inf)
        out = (mx.softmax(scores, -1) @ vv).transpose(1, 0, 2).reshape(T, -1)
        u = residual + self.lin(m + "self_attn.o_proj", out)
        x = rms(u, w[m + "post_attention_layernorm.weight"])
        mlp = self.lin(m + "mlp.down_proj", nn.silu(self.lin(m + "mlp.gate_proj", x)) *
                       self.lin(m + "mlp.up_proj", x))
        return u + mlp, k, v

    def logits(self, g, vocab):
        draft = self.lin("lm_head", rms(g, self.w["norm.weight"]))
        d2t = np.array(self.w["d2t"])
        full = np.full(vocab, -np.inf, np.float32)
        full[np.arange(d2t.shape[0]) + d2t] = np.array(draft)
        return full

    def step_logits(self, target, history, drafts):
        """The logits of each draft step after `history` (the last token not yet verified):
        pairs (h_i, x_{i+1}) for i < len(history) - 1 at positions i, then one chained step per
        draft fed back."""
        vocab = target.args.vocab_size
        embed = self.w["embed_tokens.weight"] if "embed_tokens.weight" in self.w else \
            target.model.embed_tokens.weight
        states = hidden_states_list(target, history[:-1])
        taps = mx.concatenate([states[i] for i in self.hs_ids], -1)  # (n-1, 3H)
        if "norm_before_fc" in self.flags:
            taps = rms(taps, self.w["input_norm.weight"])
        f = self.lin("fc", taps)
        n = len(history) - 1
        g, keys, values = self.layer(embed[mx.array(history[1:])], f, list(range(n)), None, None)
        g = g[-1:]
        out = [self.logits(g[0], vocab)]
        position = n - 1
        for d in drafts[:-1]:
            position += self.step
            g, keys, values = self.layer(embed[mx.array([d])], g, [position], keys, values)
            out.append(self.logits(g[0], vocab))
        return out


def random_accept(seed):
    """Accept a random number of drafts (any n in 0..k), then the target's argmax."""
    rng = np.random.default_rng(seed)

    def accept(draft_tokens, draft_probs, target_logprobs):
        n = int(rng.integers(0, draft_tokens.shape[0] + 1))
        return mx.array(n), mx.argmax(target_logprobs[n]).astype(mx.uint32)
    return accept


def recorded_steps(monkeypatch, target, head, prompt, n=50, k=3, **kwargs):
    """[(history, drafts, [logits of each step (V,)])] of every proposal of a generation."""
    seen = []
    logits = Eagle3Head.logits
    propose = Eagle3Drafter.propose
    current = []

    def spy_logits(self, g):
        out = logits(self, g)
        current.append(out)
        return out

    def spy(self, history, k):
        current.clear()
        proposal = propose(self, history, k)
        if proposal is not None:
            seen.append((list(history), proposal.tokens.tolist(),
                         [np.array(x).reshape(-1) for x in current]))  # (1, V) a step
        return proposal

    monkeypatch.setattr(Eagle3Head, "logits", spy_logits)
    monkeypatch.setattr(Eagle3Drafter, "propose", spy)
    tokens = [t for r in speculative_generate_step(prompt, target, head, max_tokens=n,
                                                   num_draft_tokens=k, calibration=None,
                                                   **kwargs) for t in r.tokens]
    monkeypatch.undo()
    return seen, tokens


def generate(target, head, prompt, n, **kwargs):
    rounds = list(speculative_generate_step(prompt, target, head, max_tokens=n,
                                            calibration=None, **kwargs))
    return ([t for r in rounds for t in r.tokens], sum(r.num_drafted for r in rounds),
            sum(r.num_accepted for r in rounds))


# --- loading -----------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_loads_the_weights_written(layout, heads, llama):
    path = heads[layout]
    assert eagle3_directory(path) == path
    head = load_eagle3(str(path))
    config = head.eagle3_config
    assert config.layout == layout
    assert config.tap_layers(LAYERS) == (1, 3, 4)  # each convention read as its code reads it
    written = {k.replace("layers.0.", "midlayer."): v
               for k, v in mx.load(str(path / "model.safetensors")).items()}
    for name, value in tree_flatten(head.parameters()):
        assert mx.array_equal(value, written[name]).item(), name
    assert mx.array_equal(head.d2t, written["d2t"]).item()
    assert "embed_tokens" not in head  # drafting borrows the target's


def test_the_three_layouts_of_the_same_weights_draft_the_same(heads, llama):
    runs = [generate(llama, load_eagle3(str(heads[layout])), PROMPT, 30, num_draft_tokens=3,
                     prompt_lookup=False) for layout in LAYOUTS]
    assert runs[0] == runs[1] == runs[2]


def test_a_draft_directory_is_detected_by_path(heads, llama):
    tokens, drafted, _ = generate(llama, str(heads[SPECFORGE]), PROMPT, 20,
                                  num_draft_tokens=2, prompt_lookup=False)
    assert tokens == plain_greedy(llama, PROMPT, 20)
    assert drafted > 0


# --- the head's logits against a from-scratch forward ------------------------------------

@pytest.mark.parametrize("which,hs_ids,flags", [
    (ORIGINAL, (2, 4, 5), ()),
    ("flags", (3, 5, 8), ("norm_before_residual", "norm_before_fc")),
    ("good", (2, 4, 5), ()),
])
def test_every_draft_step_equals_a_from_scratch_forward(which, hs_ids, flags, heads, llama,
                                                        good_head, bigram, monkeypatch):
    """After every kind of round (n = 0..k kept, at random) the head's logits at each step
    equal the published maths over the whole kept context; a tap one layer off (the other
    convention) and a chained step at the same position as the last pair must differ."""
    path = good_head if which == "good" else heads[which]
    if which == "good":
        llama = bigram
    head = load_eagle3(str(path))
    seen, _ = recorded_steps(monkeypatch, llama, head, PROMPT, n=40, k=3,
                             accept=random_accept(0), prompt_lookup=False)
    assert len(seen) > 8
    scratch = Scratch(path, hs_ids, flags)
    for history, drafts, logits in seen:
        reference = scratch.step_logits(llama, history, drafts)
        assert len(reference) == len(logits)
        for mine, theirs in zip(logits, reference):
            np.testing.assert_allclose(mine, theirs, rtol=1e-3, atol=1e-3)
    history, drafts, logits = next(entry for entry in reversed(seen) if len(entry[1]) > 1)
    if which == "good":  # its fc is scaled to nearly nothing: the taps barely count
        return
    off = Scratch(path, tuple(i + 1 for i in hs_ids[:2]) + hs_ids[2:], flags)
    assert not np.allclose(off.step_logits(llama, history, drafts)[0], logits[0], atol=1e-2)
    still = Scratch(path, hs_ids, flags, chained_position_step=0)
    assert not np.allclose(still.step_logits(llama, history, drafts)[1], logits[1], atol=1e-2)


# --- greedy parity ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_head(bigram, tmp_path_factory):
    tensors = good_head_tensors(bigram, 48, seed=7)
    return write_head(tmp_path_factory.mktemp("good") / "head", SPECULATORS, bigram, tensors,
                      DEFAULT_IDS[SPECULATORS])


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_is_the_targets_own(k, good_head, bigram):
    """A head that drafts well: partial acceptance, so rewinds after every length ran."""
    tokens, drafted, accepted = generate(bigram, load_eagle3(str(good_head)), PROMPT, 120,
                                         num_draft_tokens=k, prompt_lookup=False)
    assert tokens == plain_greedy(bigram, PROMPT, 120)
    print(f"eagle3 greedy k={k}: {accepted}/{drafted} accepted")
    assert 0 < accepted < drafted


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_with_a_random_head(k, heads, llama):
    head = load_eagle3(str(heads["flags"]))
    tokens, drafted, accepted = generate(llama, head, PROMPT, 120, num_draft_tokens=k,
                                         prompt_lookup=False)
    assert tokens == plain_greedy(llama, PROMPT, 120)
    assert drafted > 0


def test_greedy_with_lookup_in_front_and_the_adaptive_policy(heads, llama):
    head = load_eagle3(str(heads[ORIGINAL]))
    prompt = PROMPT * 3
    tokens, drafted, _ = generate(llama, head, prompt, 60)  # lookup on, adaptive k
    assert tokens == plain_greedy(llama, prompt, 60)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5", "gpt_oss", "nemotron_h"])
def test_greedy_parity_on_other_families(family, tmp_path):
    target = make_family(family, vocab_size=64)
    tensors = head_tensors(target, 40, seed=3)
    path = write_head(tmp_path / "head", SPECFORGE, target, tensors, [0, 1, 3])
    prompt = PROMPT * 2
    tokens, drafted, accepted = generate(target, str(path), prompt, 100, num_draft_tokens=3,
                                         prompt_lookup=False)
    assert tokens == plain_greedy(target, prompt, 100)
    print(f"eagle3 greedy {family}: {accepted}/{drafted} accepted")
    assert drafted > 0


# --- exact sampling ------------------------------------------------------------------------

SMALL_VOCAB = 8
# 400 samples: the unmapped-q control fails at p < 1e-200 (t1, t2 and t3, t4), the exact head
# passes at p > 0.2.
SAMPLES = 400
ALPHA = 1e-3


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A target of 8 tokens and a random head drafting over 6 of them (shuffled offsets):
    poor, so most samples reject a draft early, and sharp (weights x4), so a wrong q shows."""
    target = make_llama(vocab_size=SMALL_VOCAB, hidden=32, layers=LAYERS, seed=0)
    tensors = head_tensors(target, 6, seed=4, scale=4.0)
    path = write_head(tmp_path_factory.mktemp("small") / "head", ORIGINAL, target, tensors)
    return target, path


class UnmappedQ(Eagle3Drafter):
    """The negative control: drafts sampled right, but q handed over by draft id (before the
    vocabulary mapping), padded to the target's vocabulary."""

    def propose(self, history, k):
        self.catch_up()
        if self._last is None:
            return None
        g, tokens, probs = self._last, [], []
        head = self.head.head  # the Eagle3Head inside its pairs
        draft = head.eagle3_config.draft_vocab_size
        vocab = head.eagle3_config.vocab_size
        for i in range(k):
            lp = logprobs_from_logits(head.draft_logits(g), self.sampling)
            d = sample(lp, self.sampling)
            y = (d.astype(mx.int64) + head.d2t[d]).astype(mx.uint32)[None]
            probs.append(mx.concatenate([mx.exp(lp), mx.zeros((vocab - draft,))]))
            tokens.append(y)
            if i + 1 < k:
                g = feed(self.head, y[None], g[None, None], self.cache[0])[0, 0]
        self._chained = k - 1
        return Proposal(mx.concatenate(tokens), mx.stack(probs), self.source, self)


@pytest.mark.parametrize("control", [False, True], ids=["exact", "unmapped-q"])
def test_first_two_tokens_at_temperature_one(control, small, monkeypatch):
    target, path = small
    if control:
        monkeypatch.setattr("mlx_spec.assemble.Eagle3Drafter", UnmappedQ)
    result = check_exactness(target, load_eagle3(str(path)), [3, 1, 4], SamplingConfig(temp=1.0),
                             samples=SAMPLES, num_draft_tokens=2, alpha=ALPHA, seed=0)
    print(f"eagle3 t1,t2 control={control}: chi2={result.statistic:.1f} dof={result.dof} "
          f"p={result.p_value:.3g} acceptance={result.acceptance_rate:.2f}")
    assert 0 < result.acceptance_rate < 0.8, result
    assert result.passed != control, result


def exact_third_and_fourth(target, prompt, sampling):
    """{(t3, t4): probability} under the target alone, enumerating every t1 t2 t3."""
    joint = {(): 1.0}
    for _ in range(4):
        prefixes = list(joint)
        logits = target(mx.array([prompt + list(p) for p in prefixes]))[:, -1]
        p = np.array(mx.exp(logprobs_from_logits(logits, sampling)), np.float64)
        joint = {prefix + (t,): joint[prefix] * p[row, t]
                 for row, prefix in enumerate(prefixes) for t in range(p.shape[1])}
    exact = {}
    for tokens, prob in joint.items():
        exact[tokens[2:]] = exact.get(tokens[2:], 0.0) + prob
    return exact


@pytest.mark.parametrize("control", [False, True], ids=["exact", "unmapped-q"])
def test_tokens_after_a_mid_generation_rejection(control, small, monkeypatch):
    """Chi-square of (t3, t4) at T = 1, k = 2: most samples rejected a draft in a round that
    ended before token 3, so tokens 3 and 4 come from the rewound head cache."""
    target, path = small
    if control:
        monkeypatch.setattr("mlx_spec.assemble.Eagle3Drafter", UnmappedQ)
    head, sampling, prompt = load_eagle3(str(path)), SamplingConfig(temp=1.0), [3, 1, 4]
    mx.random.seed(1)
    counts, rewound, drafted, accepted = {}, 0, 0, 0
    for _ in range(SAMPLES):
        out, early = [], False
        for round_ in speculative_generate_step(prompt, target, head, max_tokens=4,
                                                num_draft_tokens=2, sampling=sampling,
                                                prompt_lookup=False, calibration=None,
                                                adaptive=False):
            if round_.num_accepted < round_.num_drafted and len(out) + len(round_.tokens) < 3:
                early = True
            drafted += round_.num_drafted
            accepted += round_.num_accepted
            out += round_.tokens
        rewound += early
        counts[(out[2], out[3])] = counts.get((out[2], out[3]), 0) + 1
    assert rewound > SAMPLES // 4, rewound
    assert 0 < accepted < drafted, (accepted, drafted)
    statistic, dof, p_value = chi_square(counts, exact_third_and_fourth(target, prompt, sampling))
    print(f"eagle3 t3,t4 control={control}: chi2={statistic:.1f} dof={dof} p={p_value:.3g} "
          f"rewound={rewound} acceptance={accepted / drafted:.2f}")
    assert (p_value > ALPHA) != control, (statistic, dof, p_value)


def test_the_loop_times_the_head_s_chained_step_for_the_policy(good_head, bigram):
    """Without a calibration the policy's cost of an EAGLE-3 draft is one timed chained step
    of the head (head_chain.step_seconds), not a guess; the step leaves the head as it was."""
    from mlx_spec.policy import AdaptivePolicy

    class Seen(AdaptivePolicy):
        def observe_draft_step(self, source, seconds):
            steps.append((source, seconds))
            super().observe_draft_step(source, seconds)

    steps = []
    tokens, _, _ = generate(bigram, load_eagle3(str(good_head)), PROMPT, 40,
                            policy=Seen(), prompt_lookup=False)
    assert tokens == plain_greedy(bigram, PROMPT, 40)
    assert [s for s, _ in steps] == ["eagle3"] and 0 < steps[0][1] < 1.0


def test_a_batch_row_alone_times_the_head_s_chained_step_for_its_policy(good_head, bigram,
                                                                         monkeypatch):
    """As the loop's: a row decoding alone in the batch engine times one chained step of the
    EAGLE-3 head (BatchMTP.step_seconds, on a cache of its own) before its first round, once;
    its text is the target's."""
    from mlx_spec.batch import BatchEngine, RowRequest
    from mlx_spec.policy import AdaptivePolicy

    steps, observe = [], AdaptivePolicy.observe_draft_step
    monkeypatch.setattr(AdaptivePolicy, "observe_draft_step", lambda self, source, seconds:
                        steps.append((source, seconds)) or observe(self, source, seconds))
    engine = BatchEngine(bigram, load_eagle3(str(good_head)), calibration=None)
    engine.insert(RowRequest(PROMPT, 40, prompt_lookup=False))
    tokens = []
    while engine.busy:
        for out in engine.step():
            tokens += out.tokens
    assert tokens == plain_greedy(bigram, PROMPT, 40)
    assert [s for s, _ in steps] == ["eagle3"] and 0 < steps[0][1] < 1.0


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)],
                         ids=["exact-rule", "negative-control"])
def test_batched_rows_after_a_rejection_are_distributed_as_the_target(residual, exact, small):
    """Batched rows at T = 1 (BatchMTP with the head's pairs, batch/eagle3.py), other prompts
    coming and going beside them: tokens 3 and 4 of PROMPT's rows, most after a rewound
    rejection, against the target's exact distribution; resampling from p instead of the
    residual (the negative control) must fail the same test."""
    from batch_exactness import SAMPLES as ROWS
    from batch_exactness import check_rows_after_a_rejection

    target, path = small
    check_rows_after_a_rejection(target, load_eagle3(str(path)), residual, exact,
                                 min_rewound=ROWS // 4)


# --- bad input ---------------------------------------------------------------------------

def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("case,match", [
    ("hidden", "hidden states of width"),
    ("taps", "taps target layer outputs"),
    ("vocab", "vocabulary maps cover"),
    ("d2t", "not an offset table"),
    ("t2d", "the two maps disagree"),
    ("layout", "unknown layout"),
    ("eagle1", "speculators 'eagle' model"),
])
def test_bad_heads_are_one_sentence(case, match, llama, tmp_path):
    from mlx_spec import generate as api_generate  # noqa: F401 (the API path below)
    from mlx_spec.assemble import eagle3_head_for

    target = llama
    tensors = head_tensors(llama, 48, seed=1)
    layout, ids = ORIGINAL, None
    if case == "hidden":
        target = make_llama(vocab_size=64, hidden=32, layers=LAYERS, seed=0)
    elif case == "taps":
        layout, ids = SPECFORGE, [1, 3, LAYERS]
    elif case == "vocab":
        target = make_llama(vocab_size=80, hidden=48, layers=LAYERS, seed=0)
    elif case == "d2t":
        tensors["d2t"] = mx.array(np.full(48, 60), mx.int64)
    elif case == "t2d":
        tensors["t2d"] = mx.array(np.ones(64, bool))
    path = write_head(tmp_path / "head", layout, llama, tensors, ids)
    if case == "layout":
        _edit_config(path, architectures=["LlamaForCausalLMEagle"], draft_vocab_size=None)
        config = json.loads((path / "config.json").read_text())
        del config["draft_vocab_size"]
        (path / "config.json").write_text(json.dumps(config))
    elif case == "eagle1":
        _edit_config(path, speculators_model_type="eagle", speculators_config={})
    with pytest.raises(ValueError, match=match) as info:
        eagle3_head_for(target, str(path))
    assert "\n" not in str(info.value)


# --- the command line ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_head(model_dirs, tmp_path_factory):
    """A SpecForge head for conftest's target directory (2 layers: explicit taps)."""
    from mlx_spec.loading import load

    target = load(str(model_dirs["target"]))[0]
    tensors = head_tensors(target, 200, seed=6)
    return write_head(tmp_path_factory.mktemp("cli") / "head", SPECFORGE, target, tensors,
                      [0, 1, 1])


def cli(*args):
    from click.testing import CliRunner

    from mlx_spec.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_generate_and_check_take_a_head_directory(model_dirs, cli_head):
    plain = cli("generate", "--model", model_dirs["target"], "--no-draft", "--no-prompt-lookup",
                "-n", 24, "--temp", 0, "--ignore-chat-template", "-q")
    drafted = cli("generate", "--model", model_dirs["target"], "--draft-model", cli_head,
                  "--no-prompt-lookup", "-n", 24, "--temp", 0, "--ignore-chat-template")
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.output
    assert drafted.stdout.startswith(plain.stdout.strip()[:40])
    checked = cli("check", "--model", model_dirs["target"], "--draft-model", cli_head,
                  "--samples", 200)
    assert checked.exit_code == 0, checked.output


def test_the_bench_command_measures_a_head(model_dirs, cli_head, tmp_path):
    import json

    out = tmp_path / "bench.json"
    result = cli("bench", "--model", model_dirs["target"], "--draft-model", cli_head, "--smoke",
                 "--json", out, "--max-tokens", 6, "--repeats", 1, "--no-plots")
    assert result.exit_code == 0, result.output
    assert "the draft is an EAGLE-3 head" in result.output
    measured = json.loads(out.read_text())
    assert measured["head"] == "EAGLE-3 head" and measured["draft"]["decode_s"] > 0
    assert sum(p["drafted"] for p in measured["acceptance"]) > 0


def test_a_head_for_another_target_is_one_sentence_on_the_command_line(model_dirs, heads):
    result = cli("generate", "--model", model_dirs["target"], "--draft-model", heads[ORIGINAL],
                 "-n", 4)
    assert result.exit_code != 0
    assert "use the head published for this target" in result.output


def test_a_conversation_with_a_reused_prompt_cache_and_a_quantized_target(bigram, good_head):
    """Three turns on one prompt cache give the target-alone's text (the head starts each call
    from the taps it is shown); a quantized target's embedding is borrowed as it is."""
    from mlx_spec.cache import make_cache

    target = near_bigram(make_llama(vocab_size=64, hidden=64, layers=LAYERS, seed=0))
    path = good_head.parent.parent / "q-head"
    if not path.exists():
        write_head(path, SPECULATORS, target, good_head_tensors(target, 48, seed=7),
                   DEFAULT_IDS[SPECULATORS])
    nn.quantize(target, group_size=32, bits=8)
    head = load_eagle3(str(path))

    def conversation(draft):
        cache, texts = make_cache(target), []
        for turn in (PROMPT, [7, 8, 9], [3, 4]):
            texts.append([t for r in speculative_generate_step(
                turn, target, draft, max_tokens=20, num_draft_tokens=3, prompt_cache=cache,
                calibration=None, prompt_lookup=False) for t in r.tokens])
        return texts

    assert conversation(head) == conversation(None)
