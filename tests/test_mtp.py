"""MTP drafting: the target drafts for itself with its multi-token-prediction layer.

Tiny random targets of mlx-lm's qwen3_5 / qwen3_next (hybrids: Gated DeltaNet
+ attention) and deepseek_v3 / glm4_moe classes, with random MTP weights
written in each family's published layout:

- mlx-lm's form (safetensors metadata format "mlx", norms already shifted,
  experts stacked), as a model directory `mlx_spec.load` reads;
- an "original checkpoint": an index and three shards, only the middle one
  holding MTP tensors, in the original form (zero-centred Qwen norms,
  DeepSeek's kv_b_proj and one matrix per expert, copies of the embedding
  and head); the other shards are overwritten with garbage once the index
  is written, so reading them would fail;
- the same files in a fake Hugging Face cache, read with HF_HUB_OFFLINE=1.

A "good" MTP layer is built by hand: the target's trunk is made nearly a
bigram model (its layers' output projections scaled down), and the MTP
layer passes the embedding of the token it is given straight to the shared
head, so its drafts are often right and acceptance is partial.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from families import WEIGHT_SCALE, make_family, plain_greedy
from tiny import make_llama, write_tokenizer

from mlx_spec.acceptance import resample_from_target_accept
from mlx_spec.cache import ModelCache, make_cache
from mlx_spec.drafters import MTPDrafter
from mlx_spec.exactness import check_exactness
from mlx_spec.generate import speculative_generate_step
from mlx_spec.mtp import load_mtp, split_target
from mlx_spec.mtp.heads import QWEN, make_block, mtp_style, text_model
from mlx_spec.sampling import SamplingConfig

FAMILIES = ["qwen3_5", "qwen3_next", "deepseek_v3", "glm4_moe"]
QUIET = ("o_proj.weight", "out_proj.weight", "down_proj.weight")  # a layer's outputs
EPS = 0.03  # their scale in the near-bigram target and the good MTP layer
PROMPT = [5, 9, 14, 3, 27, 8, 41, 3, 27]
MTP_SHARD = "model-00002-of-00003.safetensors"
EXACTNESS_SAMPLES = 500


# --- tiny targets ----------------------------------------------------------------------

def _moe_config(name, vocab_size):
    common = {"model_type": name, "vocab_size": vocab_size, "hidden_size": 32,
              "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "n_shared_experts": 1,
              "n_routed_experts": 4, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0,
              "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "rope_scaling": None, "attention_bias": False}
    if name == "deepseek_v3":
        return common | {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
                         "qk_rope_head_dim": 8, "v_head_dim": 8, "qk_nope_head_dim": 8,
                         "moe_layer_freq": 1}
    return common | {"head_dim": 8, "use_qk_norm": True, "tie_word_embeddings": False,
                     "partial_rotary_factor": 0.5}


def make_target(name, seed=0, vocab_size=64, quiet=True):
    """A tiny random `name` model; `quiet`: its trunk nearly a bigram model (see the docstring)."""
    if name in ("qwen3_5", "qwen3_next"):
        model = make_family(name, seed=seed, vocab_size=vocab_size)
    else:
        import importlib

        module = importlib.import_module(f"mlx_lm.models.{name}")
        mx.random.seed(seed)
        model = module.Model(module.ModelArgs.from_dict(_moe_config(name, vocab_size)))
        model.set_dtype(mx.float32)
        model.update(tree_map(lambda w: w * WEIGHT_SCALE if w.ndim >= 2 else w,
                              model.parameters()))
        model.eval()
    if quiet:
        model.load_weights([(k, w * EPS) for k, w in tree_flatten(model.parameters())
                            if k.endswith(QUIET)], strict=False)
    mx.eval(model.parameters())
    return model


def mtp_params(target, seed=1, good=True):
    """Random MTP parameters in mlx-lm's form (the block's own names)."""
    mx.random.seed(seed)
    block, style = make_block(target)
    params = {k: (w * WEIGHT_SCALE if w.ndim >= 2 else w).astype(mx.float32)
              for k, w in tree_flatten(block.parameters())}
    if good:  # the embedding half straight through, the layer nearly a pass-through
        size = text_model(target).args.hidden_size
        fc = "fc.weight" if style == QWEN else "eh_proj.weight"
        params[fc] = mx.concatenate([mx.eye(size), 0.05 * params[fc][:, size:]], axis=1)
        params.update({k: w * EPS for k, w in params.items() if k.endswith(QUIET)})
    mx.eval(params)
    return params


def checkpoint_tensors(target, params, original: bool):
    """`params` under the checkpoint's names; `original`: the original checkpoint's form."""
    if mtp_style(target) == QWEN:  # every 1-D weight is a norm, zero-centred in the original
        return {f"mtp.{k}": (w - 1.0 if original and w.ndim == 1 else w)
                for k, w in params.items()}
    n = text_model(target).args.num_hidden_layers
    out = {}
    for k, w in params.items():
        out[f"model.layers.{n}.{k.removeprefix('block.')}"] = w
    if original:
        for k in [k for k in out if ".switch_mlp." in k]:  # one matrix per expert
            stacked = out.pop(k)
            for e in range(stacked.shape[0]):
                out[k.replace(".switch_mlp.", f".experts.{e}.")] = stacked[e]
        q = f"model.layers.{n}.self_attn."
        if q + "embed_q.weight" in out:  # DeepSeek's kv_b_proj, as sanitize splits it
            wk, wv = out.pop(q + "embed_q.weight"), out.pop(q + "unembed_out.weight")
            kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)  # (heads, nope + v, rank)
            out[q + "kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
        inner = text_model(target)
        out[f"model.layers.{n}.embed_tokens.weight"] = inner.model.embed_tokens.weight
        out[f"model.layers.{n}.shared_head.head.weight"] = inner.lm_head.weight
    return out


def write_original(path, target, params):
    """An index and three shards; only the middle one holds MTP tensors, the others become garbage."""
    path.mkdir(parents=True, exist_ok=True)
    trunk = sorted(tree_flatten(target.parameters()))
    half = len(trunk) // 2
    shards = {
        "model-00001-of-00003.safetensors": dict(trunk[:half]),
        MTP_SHARD: checkpoint_tensors(target, params, original=True) | dict(trunk[half:half + 1]),
        "model-00003-of-00003.safetensors": dict(trunk[half + 1:]),
    }
    weight_map = {}
    for shard, tensors in shards.items():
        mx.save_safetensors(str(path / shard), tensors, metadata={"format": "pt"})
        weight_map.update({name: shard for name in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for shard in shards:
        if shard != MTP_SHARD:
            (path / shard).write_bytes(b"not a safetensors file")
    return path


def write_mlx_dir(path, target, params):
    """One model.safetensors in mlx-lm's form holding the MTP tensors (and the trunk's)."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = dict(tree_flatten(target.parameters())) | checkpoint_tensors(target, params, False)
    mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "mlx"})
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (target, original checkpoint dir, mlx-form dir, the MTP params)."""
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for name in FAMILIES:
        target = make_target(name)
        params = mtp_params(target)
        out[name] = (target, write_original(root / f"{name}-original", target, params),
                     write_mlx_dir(root / f"{name}-mlx", target, params), params)
    return out


def block_params(head):
    return dict(tree_flatten(head.block.parameters()))


def run(target, prompt, n=40, **kwargs):
    tokens, drafted, accepted = [], 0, 0
    for round_ in speculative_generate_step(prompt, target, "mtp", max_tokens=n,
                                            calibration=None, **kwargs):
        tokens += round_.tokens
        drafted += round_.num_drafted
        accepted += round_.num_accepted
    return tokens, drafted, accepted


# --- the verify pass also yields hidden states ---------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_split_target_keeps_the_logits(name, pairs):
    target = pairs[name][0]
    x = mx.array([PROMPT])
    trunk, head = split_target(target)
    assert mx.array_equal(head(trunk(x)), target(x)).item()
    plain = ModelCache(target, make_cache(target))
    capturing = ModelCache(target, make_cache(target), split=split_target(target))
    assert mx.array_equal(plain.forward(x[0]), capturing.forward(x[0])).item()
    assert plain.hidden is None and capturing.hidden.shape == (len(PROMPT), 32)


# --- weights ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_original_checkpoint_and_mlx_form_give_the_same_layer(name, pairs):
    """Only the shard holding MTP tensors is read (the others are garbage); both layouts agree."""
    target, original, mlx_dir, params = pairs[name]
    from_original = block_params(load_mtp(target, str(original)))
    from_mlx = block_params(load_mtp(target, str(mlx_dir)))
    for k, w in params.items():
        kept = "e_score_correction_bias" in k  # the family's cast_predicate keeps it float32
        assert from_original[k].dtype == (mx.float32 if kept else mx.bfloat16), k  # not quantized
        assert mx.array_equal(from_original[k], from_mlx[k]).item(), k
        assert mx.array_equal(from_mlx[k], w.astype(from_mlx[k].dtype)).item(), k


def _qwen_moe_target(name):
    """qwen3_next (experts stored one by one) or qwen3_5_moe (fused) with 4 experts."""
    import importlib

    dense = make_family("qwen3_next" if name == "qwen3_next" else "qwen3_5", vocab_size=64)
    config = dict(getattr(dense.args, "text_config", None) or vars(dense.args))
    config |= {"model_type": name, "num_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}
    module = importlib.import_module(f"mlx_lm.models.{name}")
    return module.Model(module.ModelArgs.from_dict(config))


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_qwen_experts_are_stacked(name, tmp_path):
    """Original checkpoints store MoE experts one by one (Qwen3-Next) or fused (Qwen3.5 MoE)."""
    target = _qwen_moe_target(name)
    params = mtp_params(target, good=False)
    tensors = checkpoint_tensors(target, params, original=True)
    prefix = "mtp.layers.0.mlp."
    gate, up, down = (tensors.pop(f"{prefix}switch_mlp.{p}.weight")
                      for p in ("gate_proj", "up_proj", "down_proj"))
    if name == "qwen3_5_moe":
        tensors[prefix + "experts.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
        tensors[prefix + "experts.down_proj"] = down
    else:
        for e in range(gate.shape[0]):
            for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                tensors[f"{prefix}experts.{e}.{proj}.weight"] = w[e]
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors, metadata={"format": "pt"})
    loaded = block_params(load_mtp(target, str(tmp_path)))
    for k, w in params.items():
        assert mx.array_equal(loaded[k], w.astype(mx.bfloat16)).item(), k


def test_hugging_face_repo_from_the_local_cache(pairs, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    target, original, _, params = pairs["qwen3_5"]
    repo = tmp_path / "models--tiny--qwen35-mtp"
    revision = "0" * 40
    shutil.copytree(original, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    head = load_mtp(target, "tiny/qwen35-mtp")
    assert mx.array_equal(block_params(head)["fc.weight"],
                          params["fc.weight"].astype(mx.bfloat16)).item()
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1"):
        load_mtp(target, "tiny/not-cached")


# --- exact output --------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("k", [1, 3, None])
def test_greedy_parity(name, k, pairs):
    target, original = pairs[name][:2]
    reference = plain_greedy(target, PROMPT, 40)
    # Adaptive k without the off switch: under a loaded test run the head's timed step can read
    # as dear as the tiny target's, and an off head drafts nothing to check.
    tokens, drafted, accepted = run(target, PROMPT, num_draft_tokens=k,
                                    mtp_weights=str(original), prompt_lookup=False,
                                    auto_off=k is not None)
    assert tokens == reference
    assert drafted > 0
    if k is not None:  # (adaptive k follows timings: what it accepts varies with the machine)
        assert 0 < accepted < drafted  # partial acceptance: rewinds ran


@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3"])
def test_greedy_parity_with_lookup_in_front(name, pairs):
    target, original = pairs[name][:2]
    prompt = PROMPT * 3
    reference = plain_greedy(target, prompt, 40)
    tokens, _, _ = run(target, prompt, mtp_weights=str(original))  # lookup on by default
    assert tokens == reference


def _random_accept(seed):
    """Accept a random number of drafts (any n in 0..k), then the target's argmax: all rewinds."""
    rng = np.random.default_rng(seed)

    def accept(draft_tokens, draft_probs, target_logprobs):
        n = int(rng.integers(0, draft_tokens.shape[0] + 1))
        return mx.array(n), mx.argmax(target_logprobs[n]).astype(mx.uint32)
    return accept


def _reference_drafts(target, head, history, k):
    """The MTP layer's drafts from scratch: the whole history through both, no cache kept."""
    trunk, _ = split_target(target)
    hidden = trunk(mx.array(history[:-1])[None])[0]  # (L-1, H)
    cache = head.make_cache()[0]
    g = head(mx.array(history[1:]), hidden, cache)[-1]
    last, drafts = g, []
    for i in range(k):
        drafts.append(int(mx.argmax(head.logits(g)).item()))
        if i + 1 < k:
            g = head(mx.array(drafts[-1:]), g[None], cache)[0]
    return last, drafts


@pytest.mark.parametrize("name,prompt,lookup", [("qwen3_5", PROMPT, False),
                                                ("deepseek_v3", [7], False),
                                                ("qwen3_next", PROMPT * 2, True)])
def test_drafts_equal_a_slow_reference(name, prompt, lookup, pairs, monkeypatch):
    """After every kind of round (n = 0..k accepted, plain steps, lookup rounds) the MTP
    layer's cache holds exactly what a fresh pass over the history gives."""
    target, original = pairs[name][:2]
    seen = []
    propose = MTPDrafter.propose

    def spy(self, history, k):
        proposal = propose(self, history, k)
        if proposal is not None:
            seen.append((list(history), self._last, proposal.tokens.tolist()))
        return proposal

    monkeypatch.setattr(MTPDrafter, "propose", spy)
    run(target, prompt, n=60, num_draft_tokens=3, mtp_weights=str(original),
        prompt_lookup=lookup, accept=_random_accept(0))
    assert len(seen) > 5
    head = load_mtp(target, str(original))
    for history, last, drafts in seen:
        reference_last, reference_drafts = _reference_drafts(target, head, history, len(drafts))
        assert mx.allclose(last, reference_last, atol=1e-4).item()
        assert drafts == reference_drafts


@pytest.mark.parametrize("name,tree", [("qwen3_5", None), ("deepseek_v3", None),
                                       ("deepseek_v3", (3, 2))])
def test_one_row_and_a_batch_of_one_draft_alike(name, tree, pairs, monkeypatch):
    """The head's chain is one implementation (head_chain.feed and chain) for a request alone
    and for a batch's rows: the same request, alone and as the batch's one row at the same k,
    drafts the same tokens round after round (the prompt's pairs, each round's kept pairs,
    the chained steps and their rewind after rejections), and gives the same text. With token
    trees (depth 3, width 2) both draft the same spines: after a round whose accepted path
    left the spine, the head's pairs are the target's states along that path."""
    from mlx_spec.batch import BatchEngine, RowRequest
    from mlx_spec.batch.mtp import BatchMTP

    target, original = pairs[name][:2]
    alone, in_batch = [], []
    propose, batch_propose = MTPDrafter.propose, BatchMTP.propose

    def spy(self, history, k):
        proposal = propose(self, history, k)
        if proposal is not None:
            alone.append(proposal.tokens.tolist())
        return proposal

    pending = []  # the row's text and the pairs' states waiting for each proposal

    def batch_spy(self, rows, k, drawn):
        waiting = [h for _, h in rows[0].mtp_pending]
        pending.append((list(rows[0].history), mx.concatenate(waiting) if waiting else None))
        tokens, q = batch_propose(self, rows, k, drawn)
        in_batch.append(tokens[0, :drawn[0]].tolist())
        return tokens, q

    monkeypatch.setattr(MTPDrafter, "propose", spy)
    monkeypatch.setattr(BatchMTP, "propose", batch_spy)
    tokens, drafted, accepted = run(target, PROMPT, n=30, num_draft_tokens=3,
                                    mtp_weights=str(original), prompt_lookup=False, tree=tree)
    engine = BatchEngine(target, "mtp", num_draft_tokens=3, mtp_weights=str(original),
                         tree=tree)
    engine.insert(RowRequest(PROMPT, 30, prompt_lookup=False))
    same, off_spine = [], 0
    while engine.busy:
        for out in engine.step():
            same += out.tokens
            off_spine += out.spine_kept is not None and out.num_accepted > out.spine_kept
    assert same == tokens
    assert in_batch == alone
    assert len(alone) > 5 and 0 < accepted < drafted  # rounds with rejections and with matches
    assert tree is None or off_spine > 0  # a sibling was kept: the path left the spine
    trunk = split_target(target)[0]
    for history, states in pending:  # each waiting pair: the target's state before its token
        if states is not None:
            whole = trunk(mx.array(history, mx.uint32)[None])[0]  # (len(history), H)
            m = states.shape[0]
            assert mx.allclose(states, whole[len(history) - m - 1:len(history) - 1],
                               atol=1e-4).item()


@pytest.mark.parametrize("seconds,drafts", [(1.0, False), (1e-6, True)],
                         ids=["costly-step", "free-step"])
def test_a_row_alone_times_the_heads_chained_step_before_its_first_round(seconds, drafts, pairs,
                                                                         monkeypatch):
    """As a call's policy times the head's chained step (head_chain.step_seconds), a row
    alone's knows what one costs before it drafts (one timed step, handed on to the next
    request): a step said to cost a second is never tried, one said to cost nothing is; no
    calibration, as a call times it only then. The step the head really times (on a cache of
    its own) is positive, and the text is the target's either way. Each request's policy is
    told its prefill's time (v's prior), as a call's is."""
    from mlx_spec.batch import BatchEngine, RowRequest
    from mlx_spec.batch.mtp import BatchMTP
    from mlx_spec.policy import AdaptivePolicy

    told, observe = [], AdaptivePolicy.observe_prefill
    monkeypatch.setattr(AdaptivePolicy, "observe_prefill", lambda self, tokens, seconds:
                        told.append(tokens) or observe(self, tokens, seconds))
    target, original = pairs["qwen3_5"][:2]
    timed, real = [], BatchMTP.step_seconds
    monkeypatch.setattr(BatchMTP, "step_seconds",
                        lambda self, row: timed.append(real(self, row)) or seconds)
    engine = BatchEngine(target, "mtp", mtp_weights=str(original), calibration=None)
    for prompt in (PROMPT, PROMPT[::-1]):  # two requests, one after the other
        engine.insert(RowRequest(prompt, 24, prompt_lookup=False))
        tokens, drafted, before = [], [], len(told)
        while engine.busy:
            for out in engine.step():
                tokens += out.tokens
                drafted.append(out.num_drafted)
        assert (max(drafted) > 0) == drafts, drafted
        assert told[before:] == [len(prompt) - 1]
        assert tokens == run(target, prompt, n=24, num_draft_tokens=2,
                             mtp_weights=str(original))[0]
    assert len(timed) == 1 and timed[0] > 0


@pytest.mark.parametrize("accept,exact", [(None, True), (resample_from_target_accept, False)])
def test_exact_sampling_at_temperature_one(accept, exact, pairs):
    """Chi-square of the first two tokens against the target's exact distribution; resampling
    rejections from p instead of p - q must fail it. The MTP layer is the good one made
    over-confident (its final norm x3): q far sharper than p, so a rule ignoring q shows."""
    target, original = pairs["deepseek_v3"][:2]  # the cheapest family (each sample re-runs the prompt)
    sharp = original.parent / "deepseek_v3-sharp"
    if not sharp.exists():
        params = mtp_params(target, seed=5)
        params["shared_head.norm.weight"] = params["shared_head.norm.weight"] * 3
        write_original(sharp, target, params)
    result = check_exactness(target, "mtp", PROMPT[:4], SamplingConfig(temp=1.0),
                             samples=EXACTNESS_SAMPLES, num_draft_tokens=2, alpha=1e-3, seed=3,
                             mtp_weights=str(sharp), accept=accept)
    assert 0 < result.acceptance_rate < 0.5, result  # rejections: the residual is sampled
    assert result.passed == exact, result


# --- the API, from a model directory -------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(model, tokenizer) that mlx_spec.load read from a qwen3_5 directory holding mtp.*."""
    import mlx_spec

    path = tmp_path_factory.mktemp("qwen35")
    vocab_size = write_tokenizer(path)
    target = make_target("qwen3_5", vocab_size=vocab_size)
    args = dict(target.args.text_config)
    (path / "config.json").write_text(json.dumps(args | {"eos_token_id": 0}))
    write_mlx_dir(path, target, mtp_params(target))
    return mlx_spec.load(str(path))


def test_stream_generate_from_a_model_directory(loaded):
    """mlx_spec.load notes the directory; draft_model="mtp" finds the MTP tensors there."""
    import mlx_lm

    import mlx_spec

    model, tokenizer = loaded
    expected = mlx_lm.generate(model, tokenizer, "def fib", max_tokens=30)
    responses = list(mlx_spec.stream_generate(model, tokenizer, "def fib", draft_model="mtp",
                                              max_tokens=30, num_draft_tokens=2,
                                              prompt_lookup=False))
    assert "".join(r.text for r in responses) == expected
    assert any(r.source == "mtp" for r in responses)


@pytest.mark.parametrize("live", [True, False])
@pytest.mark.parametrize("how", ["full", "break-held", "break-dropped", "closed-late"])
def test_conversation_with_a_reused_prompt_cache(loaded, how, live):
    """The prompt cache holds the target's layers; the MTP layer starts afresh each turn.
    prompt_cache_live=False (the server's): the cache is settled when a turn ends."""
    from mlx_lm.models.cache import make_prompt_cache
    from test_multiturn import MAX_TOKENS, _assert_same_conversation, converse, mlx_lm_turns

    import mlx_spec

    model, tokenizer = loaded

    def turn(ids, cache):
        return mlx_spec.stream_generate(model, tokenizer, ids, draft_model="mtp",
                                        max_tokens=MAX_TOKENS, prompt_cache=cache,
                                        calibration=None, prompt_cache_live=live)
    cache = make_prompt_cache(model)
    ours = converse(turn, cache, tokenizer, how, len(cache))
    want = mlx_lm_turns(model, tokenizer, how)
    if live:
        assert [t[:2] for t in ours] == [t[:2] for t in want]
    else:
        _assert_same_conversation(ours, want, how)


def test_generate_command_with_mtp(loaded):
    from click.testing import CliRunner

    from mlx_spec.cli import main
    from mlx_spec.mtp import MODEL_DIR_ATTR

    path = getattr(loaded[0], MODEL_DIR_ATTR)

    def run_cli(*args):
        return CliRunner().invoke(main, ["generate", "-m", path, "-n", "20", *args])
    plain, mtp = run_cli("--no-draft", "-q"), run_cli("--mtp")
    assert mtp.exit_code == 0, mtp.output
    assert mtp.stdout.splitlines()[0] == plain.stdout.splitlines()[0]
    bad = run_cli("--mtp-weights", path)
    assert bad.exit_code == 2 and "--mtp-weights is only used with --mtp" in bad.output


# --- bad input -----------------------------------------------------------------------

def test_a_family_without_mtp_is_one_sentence():
    with pytest.raises(ValueError, match=r"this target is a llama; draft with a draft model"):
        run(make_llama(seed=0), PROMPT)


def test_missing_weights_name_both_sources(pairs, tmp_path):
    target = make_target("qwen3_5", seed=2)  # not loaded by mlx_spec.load: no directory known
    with pytest.raises(ValueError, match=r"mtp_weights=.*or load the model with mlx_spec.load"):
        run(target, PROMPT)
    empty = tmp_path / "empty"
    empty.mkdir()
    mx.save_safetensors(str(empty / "model.safetensors"), {"x": mx.zeros(1)})
    with pytest.raises(ValueError, match=r"No MTP weights were found in .*empty"):
        run(target, PROMPT, mtp_weights=str(empty))


def test_an_unreadable_mtp_shard_is_one_sentence(pairs, tmp_path):
    target, _, _, params = pairs["qwen3_5"]
    path = write_original(tmp_path / "broken", target, params)
    (path / MTP_SHARD).write_bytes(b"truncated")
    with pytest.raises(ValueError, match=r"Could not read the MTP weights' shard .*complete"):
        load_mtp(target, str(path))


def test_mismatched_shapes_are_one_sentence(pairs, tmp_path):
    target = pairs["qwen3_5"][0]
    other = make_family("qwen3_5", seed=0, vocab_size=64)
    other_params = {k: mx.concatenate([w, w], axis=0) if k == "fc.weight" else w
                    for k, w in mtp_params(other).items()}
    path = write_mlx_dir(tmp_path / "other", other, other_params)
    with pytest.raises(ValueError, match=r"fc.weight has shape \(64, 64\) where the target's MTP "
                                         r"layer needs \(32, 64\)"):
        load_mtp(target, str(path))


@pytest.mark.parametrize("kwargs,match", [
    ({"draft_model": "eagle"}, "Model path 'eagle' does not exist"),  # a path: nothing there
    ({"draft_model": None, "mtp_weights": "x/y"}, 'mtp_weights is only used with draft_model="mtp"'),
    ({"draft_model": "mtp", "mtp_weights": "./no/such/dir"}, "neither a local directory nor"),
])
def test_bad_arguments(pairs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        next(speculative_generate_step(PROMPT, pairs["qwen3_5"][0], **kwargs))
