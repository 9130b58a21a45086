"""The defaults a caller sees, in a module that imports nothing.

The command line shows them in `--help`, and `mlx-spec --help` must not
import MLX to do so; the modules that use them (generate, policy, prompt
lookup) take them from here.
"""

DEFAULT_MAX_TOKENS = 256
DEFAULT_NUM_DRAFT_TOKENS = 4  # k when it is fixed and not pinned
DEFAULT_MAX_DRAFT_TOKENS = 8  # the largest k the adaptive policy may choose
DEFAULT_MAX_LOOKUP_TOKENS = 32  # the longest prompt-lookup proposal the adaptive policy may choose
DEFAULT_MAX_NGRAM = 3  # the longest n-gram prompt lookup matches
DEFAULT_KV_GROUP_SIZE = 64  # mlx-lm's kv_group_size (KV cache quantization: cache/quantize.py)
DEFAULT_QUANTIZED_KV_START = 5000  # mlx-lm's quantized_kv_start
DEFAULT_PREFILL_STEP_SIZE = 512  # prompt tokens a prefill chunk feeds
MLX_LM_PREFILL_STEP_SIZE = 2048  # mlx-lm's: kv_bits' default (where a prompt's cache is quantized)
DEFAULT_XTC_THRESHOLD = 0.1  # mlx-lm's (generate and its server)


def default_prefill_step_size(kv_bits=None, max_kv_size=None) -> int:
    """Prompt tokens a prefill chunk feeds when the caller names none: 512, or mlx-lm's 2048
    where its chunks decide what the cache holds (kv_bits: where a long prompt's cache is
    quantized; max_kv_size: what a chunk sees of a window's kept first tokens)."""
    if kv_bits is None and max_kv_size is None:
        return DEFAULT_PREFILL_STEP_SIZE
    return MLX_LM_PREFILL_STEP_SIZE
