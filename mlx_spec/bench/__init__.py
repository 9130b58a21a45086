"""`mlx-spec bench`: is speculation worth it on this machine, with these models, and why?

Measures the machine (chip, device, BLAS, memory bandwidth), each model's
decoding cost and verify-cost curve, acceptance over k and temperature, the
end-to-end tokens/s of the target alone, mlx-lm's speculative mode and
mlx-spec side by side, the cost model's prediction and recommended k, and
how the speed-up scales with k, temperature, context, target size and batch.

    from mlx_spec.bench import run_bench, quick_config
    result = run_bench(target_model, draft_model, tokenizer, quick_config())

Modules are named after what they measure; `runner` orders them, `report`
and `plots` present them, `cli` is the command line.
"""

from .runner import BenchConfig, BenchResult, quick_config, run_bench, tiny_config

__all__ = ["BenchConfig", "BenchResult", "quick_config", "run_bench", "tiny_config"]
