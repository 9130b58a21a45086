"""GGUF models: tiny mlx-lm models written as GGUF files the way llama.cpp writes them, read back.

Each test writes a random model of one architecture with llama.cpp's layout (names,
Q/K rows permuted for the llama family, Gemma's norms stored as w + 1, tied
embeddings, one quantization type) and checks that `mlx_spec.load` gives the
logits of the same weights loaded the ordinary way (the reference model holds
the `gguf` package's own dequantization of what was written).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import mlx.core as mx
from mlx.utils import tree_flatten

from gguf_files import byte_level_tokens, write_gguf

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from mlx_spec import load  # noqa: E402
from mlx_spec.gguf import weights as W  # noqa: E402
from mlx_spec.gguf.reader import GgufTensor  # noqa: E402

VOCAB = 256 + 32  # the 256 byte symbols and 32 merges


def _tokenizer_fields():
    merges = [f"{a} {b}" for a, b in zip("abcdefghijklmnopqrstuvwxyzabcdef",
                                          "bcdefghijklmnopqrstuvwxyzabcdefg")]
    tokens, types = byte_level_tokens(merges)
    return dict(model="gpt2", pre="gpt-2", tokens=tokens, token_types=types, merges=merges,
                bos=0, eos=1)


# mlx-lm names -> llama.cpp names, written here independently of mlx_spec.gguf.weights
_LEAVES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
}
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(name: str, arch: str) -> str:
    stem, leaf = name.rsplit(".", 1)
    if stem == "model.embed_tokens":
        return f"token_embd.{leaf}"
    if stem == "model.norm":
        return f"output_norm.{leaf}"
    if stem == "lm_head":
        return f"output.{leaf}"
    _, _, layer, rest = stem.split(".", 3)
    table = dict(_LEAVES, **(_GEMMA_NORMS if arch == "gemma3" else
                             {"post_attention_layernorm": "ffn_norm"}))
    return f"blk.{layer}.{table[rest]}.{leaf}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert script's `permute` (its RoPE layout for the llama family)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def make_model(arch: str, seed=0):
    mx.random.seed(seed)
    if arch == "gemma3":
        from mlx_lm.models import gemma3_text as family
        args = family.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6,
                                intermediate_size=128, num_attention_heads=2, head_dim=32,
                                num_key_value_heads=1, vocab_size=VOCAB, sliding_window=8,
                                query_pre_attn_scalar=32, rms_norm_eps=1e-6)
    else:
        from mlx_lm.models import llama, qwen2, qwen3
        family = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3}[arch]
        args = family.ModelArgs.from_dict(dict(
            model_type=arch, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
            head_dim=16, tie_word_embeddings=False, rope_theta=10000.0,
            max_position_embeddings=256))
    model = family.Model(args)
    # scale up so the output depends on the context (and norms on their weights)
    params = {k: (v * 3.0 if v.ndim == 2 else v + 0.3 * mx.random.normal(v.shape))
              for k, v in tree_flatten(model.parameters())}
    if arch == "qwen2":  # its q/k/v biases
        params = {k: (v + 0.5 * mx.random.normal(v.shape) if k.endswith(".bias") else v)
                  for k, v in params.items()}
    model.load_weights(list(params.items()))
    return model, family


def write_model(path, model, arch, qtype=Q.F32, tied=False, permute=True, extra=None):
    """The model as llama.cpp would write it; returns the dequantized weights written (mlx names)."""
    from gguf import GGUFWriter, quants

    args = model.args
    params = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    if tied or arch == "gemma3":
        params.pop("lm_head.weight", None)
    writer = GGUFWriter(str(path), arch)
    prefix = arch
    writer.add_block_count(args.num_hidden_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(args.hidden_size)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_attention_heads)
    writer.add_head_count_kv(args.num_key_value_heads)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_rope_freq_base(args.rope_theta)
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(args.sliding_window)
    fields = _tokenizer_fields()
    writer.add_tokenizer_model(fields["model"])
    writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["token_types"])
    writer.add_token_merges(fields["merges"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    written = {}
    for name, value in params.items():
        stored = value
        if arch == "gemma3" and name.endswith("norm.weight"):
            stored = value + 1.0
        if permute and arch == "llama" and ".q_proj." in name:
            stored = llama_cpp_permute(value, args.num_attention_heads)
        if permute and arch == "llama" and ".k_proj." in name:
            stored = llama_cpp_permute(value, args.num_key_value_heads)
        if value.ndim == 2 and qtype not in (Q.F32,):
            data = quants.quantize(stored.astype(np.float32), qtype)
            writer.add_tensor(gguf_name(name, arch), data, raw_shape=data.shape, raw_dtype=qtype)
            back = quants.dequantize(data, qtype).reshape(stored.shape)
        else:
            writer.add_tensor(gguf_name(name, arch), stored.astype(np.float32))
            back = stored
        if arch == "gemma3" and name.endswith("norm.weight"):
            back = back - 1.0
        if permute and arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = args.num_attention_heads if ".q_proj." in name else args.num_key_value_heads
            # undo the permutation of what was read back: the inverse of llama_cpp_permute
            back = (back.reshape(heads, back.shape[0] // heads // 2, 2, -1)
                    .swapaxes(1, 2).reshape(back.shape))
        written[name] = back
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def reference(family, model, written):
    """The same architecture holding the written (dequantized) weights, loaded the ordinary way."""
    args = model.args
    if "lm_head.weight" not in written and hasattr(args, "tie_word_embeddings"):
        args = dataclasses.replace(args, tie_word_embeddings=True)
    ref = family.Model(args)
    weights = {k: mx.array(v) for k, v in written.items()}
    if hasattr(ref, "sanitize"):
        weights = ref.sanitize(weights)
    ref.load_weights(list(weights.items()))
    return ref


TOKENS = mx.array([[5, 77, 12, 140, 9, 33, 200, 31, 64, 2, 18, 250, 7, 99, 101, 45, 8, 13,
                    270, 3]])


def logits_gap(a, b) -> float:
    return mx.abs(a(TOKENS) - b(TOKENS)).max().item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_float_weights_give_the_original_logits(tmp_path, arch):
    model, family = make_model(arch)
    written = write_model(tmp_path / "m.gguf", model, arch, tied=(arch == "qwen3"))
    loaded, tokenizer = load(str(tmp_path / "m.gguf"), dtype="float32")
    assert logits_gap(loaded, reference(family, model, written)) < 1e-4
    assert tokenizer.encode("abc") == tokenizer.encode("abc")  # it has one
    if arch == "llama":  # untied, float: the very original weights
        assert logits_gap(loaded, model) < 1e-4


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_each_quantization_type_is_read_exactly(tmp_path, qtype):
    model, family = make_model("llama")
    written = write_model(tmp_path / "m.gguf", model, "llama", qtype=qtype)
    loaded, _ = load(str(tmp_path / "m.gguf"), dtype="float32")
    ref = reference(family, model, written)
    assert logits_gap(loaded, ref) < 1e-3
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):  # kept quantized, bit for bit
        proj = loaded.model.layers[0].self_attn.q_proj
        assert hasattr(proj, "scales") and proj.group_size == 32


def test_permuted_qk_are_put_back_and_the_check_can_fail(tmp_path, monkeypatch):
    """A llama stored with permuted Q/K gives the original's logits; read as stored, it does not."""
    import mlx_spec.gguf.load as gguf_load

    model, family = make_model("llama")
    write_model(tmp_path / "m.gguf", model, "llama")
    loaded, _ = load(str(tmp_path / "m.gguf"), dtype="float32")
    assert logits_gap(loaded, model) < 1e-4
    monkeypatch.setattr(gguf_load, "PERMUTED_QK", set())  # negative control: no un-permuting
    wrong, _ = load(str(tmp_path / "m.gguf"), dtype="float32")
    assert logits_gap(wrong, model) > 1e-2


def test_gemma_norms_and_sliding_window(tmp_path, monkeypatch):
    """Gemma 3: norms stored as w + 1 come back as w; the window binds inside the test's 20 tokens;
    without the shift (negative control) the logits differ."""
    import mlx_spec.gguf.load as gguf_load

    model, family = make_model("gemma3")
    written = write_model(tmp_path / "g.gguf", model, "gemma3")
    loaded, _ = load(str(tmp_path / "g.gguf"))
    assert loaded.args.sliding_window == 8 and loaded.args.sliding_window_pattern == 6
    assert loaded.model.layers[0].self_attn.is_sliding and not loaded.model.layers[5].self_attn.is_sliding
    assert logits_gap(loaded, reference(family, model, written)) < 1e-3
    monkeypatch.setattr(gguf_load, "NORM_PLUS_ONE", set())
    wrong, _ = load(str(tmp_path / "g.gguf"))
    assert logits_gap(wrong, model) > 1e-2


def test_llama3_rope_frequency_factors(tmp_path):
    """Llama 3.1+ files carry rope_freqs (llama.cpp's per-pair factors) instead of a scaling config."""
    from mlx_lm.models import llama

    model, _ = make_model("llama")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    scaled = llama.Model(dataclasses.replace(model.args, rope_scaling=scaling))
    scaled.load_weights(list(tree_flatten(model.parameters())))
    dims, base = 16, model.args.rope_theta
    rope = scaled.model.layers[0].self_attn.rope
    factors = np.array(rope._freqs) / base ** (np.arange(0, dims, 2) / dims)
    assert factors.max() > 1.5  # the scaling changes some pairs
    write_model(tmp_path / "l3.gguf", model, "llama",
                extra={"rope_freqs.weight": factors.astype(np.float32)})
    loaded, _ = load(str(tmp_path / "l3.gguf"), dtype="float32")
    long_tokens = mx.concatenate([TOKENS] * 4, axis=1)  # 80 positions: past the original 64
    assert mx.abs(loaded(long_tokens) - scaled(long_tokens)).max().item() < 1e-3
    assert mx.abs(loaded(long_tokens) - model(long_tokens)).max().item() > 1e-2


def test_tied_embeddings(tmp_path):
    model, family = make_model("llama")
    written = write_model(tmp_path / "t.gguf", model, "llama", tied=True, qtype=Q.Q8_0)
    loaded, _ = load(str(tmp_path / "t.gguf"), dtype="float32")
    assert loaded.args.tie_word_embeddings and "lm_head" not in loaded
    assert logits_gap(loaded, reference(family, model, written)) < 1e-3


def test_dequantize_on_request(tmp_path):
    model, _ = make_model("llama")
    write_model(tmp_path / "m.gguf", model, "llama", qtype=Q.Q4_0)
    loaded, _ = load(str(tmp_path / "m.gguf"), dequantize=True, dtype="float16")
    proj = loaded.model.layers[0].self_attn.q_proj
    assert not hasattr(proj, "scales") and proj.weight.dtype == mx.float16


def _random_blocks(kind, n_blocks, seed=0):
    """Random K-quant blocks with sane fp16 super-block scales (d, dmin)."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[kind][1]
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if kind in (Q.Q4_K, Q.Q5_K):
        blocks[:, 0:4] = np.array([0.01, 0.02], dtype=np.float16).view(np.uint8)
    elif kind == Q.Q6_K:
        blocks[:, -2:] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return blocks


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants(kind):
    """Q4_K and Q5_K sub-blocks repack exactly; Q6_K (16-value blocks) is re-quantized to 8 bits."""
    rows, columns = 4, 512
    blocks = _random_blocks(kind, rows * columns // 256)
    tensor = GgufTensor("blk.0.ffn_up.weight", (columns, rows), kind, blocks.reshape(-1))
    expected = gguf.quants.dequantize(blocks.reshape(rows, -1), kind).reshape(rows, columns)
    converted = W.convert_tensor(tensor, mx.float32)
    a = converted.arrays
    got = np.array(mx.dequantize(a["weight"], a["scales"], a["biases"], 32,
                                 converted.quantization["bits"]))
    if kind == Q.Q6_K:
        assert converted.quantization["bits"] == 8 and "re-quantized" in converted.how
        groups = expected.reshape(rows, -1, 32)
        step = (groups.max(-1) - groups.min(-1)) / 255  # one 8-bit step of each group: MLX rounds within a step
        assert (np.abs(got - expected).reshape(rows, -1, 32).max(-1) <= step * 1.01 + 1e-6).all()
    else:
        assert "exactly" in converted.how
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_bits_is_mlx_packing(bits):
    rng = np.random.default_rng(bits)
    w = mx.array(rng.normal(size=(3, 64)).astype(np.float32))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    s, b = np.repeat(np.array(scales), 32, 1), np.repeat(np.array(biases), 32, 1)
    q = np.clip(np.round((np.array(w) - b) / s), 0, 2 ** bits - 1).astype(np.uint8)
    np.testing.assert_array_equal(W.pack_bits(q, bits), np.array(packed))


# ---- where a GGUF file can be, and bad files ----

def test_directory_and_blob(tmp_path):
    model, _ = make_model("llama")
    folder = tmp_path / "folder"
    folder.mkdir()
    write_model(folder / "only.gguf", model, "llama")
    blob = tmp_path / "sha256-0123abcd"  # an Ollama blob: no suffix
    blob.write_bytes((folder / "only.gguf").read_bytes())
    for path in (folder, blob):
        loaded, _ = load(str(path), dtype="float32")
        assert logits_gap(loaded, model) < 1e-4
    write_model(folder / "second.gguf", model, "llama")
    with pytest.raises(ValueError, match="several GGUF files"):
        load(str(folder))


def test_bad_files_are_one_sentence(tmp_path):
    model, _ = make_model("llama")
    good = tmp_path / "m.gguf"
    write_model(good, model, "llama")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size - 1000])
    with pytest.raises(ValueError, match="cut short"):
        load(str(cut))
    header_cut = tmp_path / "header.gguf"
    header_cut.write_bytes(good.read_bytes()[:300])
    with pytest.raises(ValueError, match="truncated"):
        load(str(header_cut))
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load(str(not_gguf))
    mamba = write_gguf(tmp_path / "mamba.gguf", arch="mamba", **_tokenizer_fields())
    with pytest.raises(ValueError, match="architecture 'mamba' is not supported"):
        load(str(mamba))
    with pytest.raises(ValueError, match="takes only"):
        load(str(good), lazy=True)
    with pytest.raises(ValueError, match="dtype"):
        load(str(good), dtype="int8")


def test_file_without_tokenizer(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "bare.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError):
        load(str(path))


def test_cli_refuses_a_bad_file_in_one_sentence(tmp_path):
    from click.testing import CliRunner

    from mlx_spec.cli import main

    fake = tmp_path / "fake.gguf"
    fake.write_text("hello")
    result = CliRunner().invoke(main, ["generate", "--model", str(fake), "--prompt", "x"])
    assert result.exit_code == 2
    assert "not a GGUF file" in result.output and "Traceback" not in result.output


def test_the_cli_dequantizes_a_gguf_model_on_request(tmp_path):
    """--dequantize reaches load for a GGUF file (its matrices stay floats), and is one
    sentence, exit 2, where no model given is a GGUF file."""
    from click.testing import CliRunner

    from mlx_spec.cli import main
    from mlx_spec.cli.models import load_model

    model, _ = make_model("llama")
    write_model(tmp_path / "m.gguf", model, "llama", qtype=Q.Q4_0)
    kept, _ = load_model(str(tmp_path / "m.gguf"), "target")
    floats, _ = load_model(str(tmp_path / "m.gguf"), "target", dequantize=True)
    assert hasattr(kept.model.layers[0].self_attn.q_proj, "scales")
    assert not hasattr(floats.model.layers[0].self_attn.q_proj, "scales")
    result = CliRunner().invoke(main, ["generate", "--dequantize", "--prompt", "x"])
    assert result.exit_code == 2
    assert "--dequantize reads GGUF files" in result.output and "Traceback" not in result.output
