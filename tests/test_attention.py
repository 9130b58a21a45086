"""The composed attention used for a round's short passes on CUDA, checked on the CPU."""

import mlx.core as mx
import pytest

import mlx_spec.attention as attention
from mlx_spec.attention import SHORT_QUERIES, composed_attention, round_attention
from mlx_spec.generate import speculative_generate_step


def qkv(n_q, n_kv, L, S, dtype, seed=0):
    mx.random.seed(seed)
    shape = lambda n, T: (2, n, T, 16)  # noqa: E731
    return (mx.random.normal(shape(n_q, L)).astype(dtype),
            mx.random.normal(shape(n_kv, S)).astype(dtype),
            mx.random.normal(shape(n_kv, S)).astype(dtype))


def masks(n_q, L, S, dtype):
    some = mx.random.uniform(shape=(2, n_q, L, S)) > 0.3
    some[..., 0] = True  # every query sees at least one key
    return {"none": None, "causal": "causal", "bool per head": some,
            "bool shared": some[:, :1], "additive": mx.random.normal((L, S)).astype(dtype)}


@pytest.mark.parametrize("n_q,n_kv,L,S", [(4, 4, 5, 9), (8, 2, 3, 17), (4, 1, 2, 6)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_composed_attention_matches_the_fused_kernel(n_q, n_kv, L, S, dtype):
    q, k, v = qkv(n_q, n_kv, L, S, dtype)
    for name, mask in masks(n_q, L, S, dtype).items():
        fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        composed = composed_attention(q, k, v, scale=0.25, mask=mask)
        tolerance = 1e-5 if dtype == mx.float32 else 2e-3
        assert mx.allclose(fused, composed, atol=tolerance).item(), name


def test_causal_mask_lets_query_i_see_keys_up_to_s_minus_l_plus_i():
    q, k, v = qkv(2, 2, 3, 7, mx.float32)
    out = composed_attention(q, k, v, scale=0.25, mask="causal")
    for i in range(3):  # query i against an explicit prefix of S - L + i + 1 keys
        keys = 7 - 3 + i + 1
        one = composed_attention(q[:, :, i:i + 1], k[:, :, :keys], v[:, :, :keys], scale=0.25)
        assert mx.allclose(out[:, :, i:i + 1], one, atol=1e-6).item()


def test_round_attention_routes_only_short_multi_token_queries(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "composed_attention",
                        lambda *a, **kw: calls.append(a[0].shape[2]) or composed_attention(*a, **kw))
    fused = mx.fast.scaled_dot_product_attention
    with round_attention(enabled=True):
        assert mx.fast.scaled_dot_product_attention is not fused
        for L in (1, 2, SHORT_QUERIES, SHORT_QUERIES + 1):
            q, k, v = qkv(2, 2, L, L + 4, mx.float32)
            mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert calls == [2, SHORT_QUERIES]
    assert mx.fast.scaled_dot_product_attention is fused


def test_round_attention_is_undone_after_an_error_and_off_on_the_cpu():
    fused = mx.fast.scaled_dot_product_attention
    with pytest.raises(RuntimeError):
        with round_attention(enabled=True):
            raise RuntimeError("boom")
    assert mx.fast.scaled_dot_product_attention is fused
    if mx.default_device().type == mx.DeviceType.cpu:
        with round_attention():
            assert mx.fast.scaled_dot_product_attention is fused


@pytest.mark.parametrize("draft_name", ["related", "unrelated"])
@pytest.mark.parametrize("k", [2, 5])
def test_greedy_parity_with_composed_round_attention(monkeypatch, target_model, drafts,
                                                     draft_name, k):
    def run(**kwargs):
        out = []
        for r in speculative_generate_step([3, 1, 4, 1, 5], target_model, max_tokens=40,
                                           **kwargs):
            out += r.tokens
        return out[:40]

    plain = run()
    monkeypatch.setattr(attention, "_needs_composed", lambda: True)
    assert run(draft_model=drafts[draft_name], num_draft_tokens=k, prompt_lookup=False) == plain
