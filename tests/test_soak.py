"""Soak: 1,000 generations in one process keep memory flat (opt-in: `pytest -m soak`)."""

import mlx.core as mx
import pytest

from mlx_spec import stream_generate

pytestmark = pytest.mark.soak


def test_thousand_generations_keep_memory_flat(model_dirs):
    from mlx_spec import load

    target_model, tokenizer = load(str(model_dirs["target"]))
    draft_model, _ = load(str(model_dirs["draft"]))
    prompts = ["def f(x):", "class A:", "import os\n", "for i in range(10):"]
    active = {}
    for i in range(1000):
        for _ in stream_generate(target_model, tokenizer, prompts[i % 4], draft_model=draft_model,
                                 max_tokens=8, prompt_lookup=i % 2 == 0):
            pass
        if i + 1 in (100, 1000):
            mx.clear_cache()
            active[i + 1] = mx.get_active_memory()
    print(f"active memory after 100 and 1,000 generations: {active}")
    assert active[1000] <= active[100] * 1.05 + 1e6, active
