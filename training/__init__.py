"""The training pipeline of the shipped default models, one module per stage.

- ``data``: the stdlib corpus, its split, the tokenizer, batches.
- ``models``: the PyTorch Llama and the MTP head.
- ``stages``: LR schedule, one resumable stage, the losses, the target's continuations.
- ``evaluation``: held-out loss, exact speculative simulation, the MLX check.
- ``export``: the Hugging Face layout mlx_lm loads.
- ``mtp``: the MTP head's drafting in the simulation, export, MLX check, held-out quality.
- ``report``: the default models' README.md from metrics.json.

``python -m training.train_default_models`` runs them in order (``--help``).
"""
