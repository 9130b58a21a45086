"""Verify-cost curve of the shipped target in float16 (as shipped) and float32.

    python -m bench.studies.verify_cost_dtype
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python -m bench.studies.verify_cost_dtype

Shows why the BLAS library matters for fp32 models on MLX's Linux CPU backend
and hardly at all for the float16 pair: the time of one forward over T tokens
relative to T = 1, interleaved medians after a 256-token prefix. Prints the
curves; writes no file.
"""

import mlx.core as mx

from mlx_spec import load
from mlx_spec.bench.forward import forward_seconds, prefilled_cache
from mlx_spec.bench.machine import blas_library

LENGTHS = (1, 2, 4, 8, 16)

if __name__ == "__main__":
    print(f"BLAS: {blas_library()}")
    for dtype in (mx.float16, mx.float32):
        target_model, _ = load()
        target_model.set_dtype(dtype)
        seconds = forward_seconds(target_model, prefilled_cache(target_model, 256), LENGTHS,
                                  repeats=7)
        curve = {t: seconds[t] / seconds[1] for t in LENGTHS}
        print(f"{dtype}: " + "  ".join(f"T={t}: {curve[t]:.2f}" for t in LENGTHS))
