"""The server's one worker as the tests build it: batching, or one request at a time."""

from mlx_spec.server.worker import GenerationWorker


def batched_worker(*args, **kwargs) -> GenerationWorker:
    """GenerationWorker(..., batching=True): every job in the batch engine."""
    return GenerationWorker(*args, batching=True, **kwargs)
