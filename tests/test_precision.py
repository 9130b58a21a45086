"""Drafters compute in float32 on the CPU backend; the target is never converted; output exact."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from dflash_tiny import make_dflash
from mlx.utils import tree_flatten
from tiny import make_llama

from mlx_spec import precision
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig

PROMPT = [1, 2, 3, 4, 5, 6, 7]


def half(model):
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


def tokens_of(target, draft=None, **kwargs):
    out = []
    for round_ in speculative_generate_step(PROMPT, target, draft, max_tokens=40,
                                            prompt_lookup=False, sampling=SamplingConfig(),
                                            calibration=None, **kwargs):
        out += round_.tokens
    return out[:40]


def weight_dtypes(module):
    return {w.dtype for _, w in tree_flatten(module.parameters())}


@pytest.fixture
def on_cpu(monkeypatch):
    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("the conversion happens on the CPU backend only")
    monkeypatch.delenv("MLX_SPEC_DRAFT_DTYPE", raising=False)


def test_a_half_precision_draft_drafts_in_float32_and_the_target_is_untouched(on_cpu):
    target = half(make_llama(seed=0))
    draft = half(make_llama(seed=5, hidden=32, layers=1))
    reference = tokens_of(target)
    for k in (1, 3, 6):
        assert tokens_of(target, draft, num_draft_tokens=k) == reference
    assert weight_dtypes(draft) == {mx.float32}
    assert weight_dtypes(target) == {mx.float16}
    assert tokens_of(target, target, num_draft_tokens=3) == reference  # drafting for itself
    assert weight_dtypes(target) == {mx.float16}


def test_native_keeps_the_drafters_dtype_and_quantized_drafters_stay(on_cpu, monkeypatch):
    target = half(make_llama(seed=0))
    monkeypatch.setenv("MLX_SPEC_DRAFT_DTYPE", "native")
    draft = half(make_llama(seed=5, hidden=32, layers=1))
    tokens_of(target, draft, num_draft_tokens=2)
    assert weight_dtypes(draft) == {mx.float16}
    monkeypatch.delenv("MLX_SPEC_DRAFT_DTYPE")
    quantized = half(make_llama(seed=5, hidden=64, layers=1))
    nn.quantize(quantized, group_size=32, bits=4)
    before = weight_dtypes(quantized)
    assert tokens_of(target, quantized, num_draft_tokens=2) == tokens_of(target)
    assert weight_dtypes(quantized) == before


def test_a_dflash_drafter_in_float32_with_a_copy_of_the_head(on_cpu, tmp_path):
    target = half(make_llama(seed=0, hidden=64, layers=4))
    drafter = half(make_dflash(tmp_path / "d", 64, [1, 3], block_size=8))
    reference = tokens_of(target)
    for k in (2, 7):
        assert tokens_of(target, drafter, num_draft_tokens=k) == reference
    assert weight_dtypes(drafter) == {mx.float32}
    assert weight_dtypes(target) == {mx.float16}


def test_head_for_computes_the_heads_output():
    x = mx.random.normal((3, 16))
    linear = nn.Linear(16, 40, bias=True)
    linear.set_dtype(mx.float16)
    expected = linear(x.astype(mx.float16)).astype(mx.float32)
    head = precision.head_for(linear, mx.float32)
    assert head(x).dtype == mx.float32
    assert mx.allclose(head(x), expected, atol=0.05).item()
    assert precision.head_for(linear, mx.float16) is linear
    embedding = nn.Embedding(40, 16)
    embedding.set_dtype(mx.float16)
    tied = precision.head_for(embedding.as_linear, mx.float32)
    assert mx.allclose(tied(x), embedding.as_linear(x.astype(mx.float16)).astype(mx.float32),
                       atol=0.05).item()


def test_a_head_too_large_to_copy_gets_rows_in_its_own_dtype(monkeypatch):
    monkeypatch.setattr(precision, "HEAD_COPY_LIMIT", 16)
    linear = nn.Linear(16, 40, bias=False)
    linear.set_dtype(mx.float16)
    out = precision.head_for(linear, mx.float32)(mx.random.normal((2, 16)))
    assert out.dtype == mx.float16  # the head ran in its own dtype: no per-round copy
    quantized = nn.QuantizedLinear(64, 40, bias=False, group_size=32, bits=4)
    quantized.set_dtype(mx.float16)
    out = precision.head_for(quantized, mx.float32)(mx.random.normal((2, 64)))
    assert out.dtype == mx.float16


def test_the_shipped_mtp_head_and_lookup_in_front_stay_exact_in_float32(on_cpu):
    """The float16 shipped target: its MTP layer drafts in float32, with prompt lookup in front
    of the draft model too; both give the target's own greedy tokens."""
    from mlx_spec import load_default_pair

    target, draft, tokenizer = load_default_pair()
    ids = tokenizer.encode("def fibonacci(n):\n    a, b = 0, 1\n    for")
    def run(draft_model, **kwargs):
        out = []
        for round_ in speculative_generate_step(ids, target, draft_model, max_tokens=32,
                                                sampling=SamplingConfig(), calibration=None,
                                                **kwargs):
            out += round_.tokens
        return out[:32]
    reference = run(None, prompt_lookup=False)
    assert run("mtp", num_draft_tokens=3) == reference
    assert run(draft, prompt_lookup=True) == reference
    assert weight_dtypes(draft) == {mx.float32}
    assert weight_dtypes(target) == {mx.float16}


def test_an_unknown_draft_dtype_setting_is_one_sentence(monkeypatch):
    monkeypatch.setenv("MLX_SPEC_DRAFT_DTYPE", "fp16")
    with pytest.raises(ValueError) as error:
        precision.upcasting()
    assert str(error.value).count(".") == 1 and "fp16" in str(error.value)
