"""Several prompts decoded together in one batch, each speculating, each as if alone.

    python examples/batch.py
"""

from mlx_spec import batch_generate, generate, load_default_pair

target_model, draft_model, tokenizer = load_default_pair()
prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):",
           "import os\n\ndef list_files(path):", "def quicksort(xs):"]

result = batch_generate(target_model, tokenizer, prompts, draft_model=draft_model,
                        max_tokens=64, verbose=True)
for prompt, text in zip(prompts, result.texts):
    print(f"--- {prompt!r}\n{text}")
alone = [generate(target_model, tokenizer, p, max_tokens=64, prompt_lookup=False) for p in prompts]
print("each identical to the target alone:", result.texts == alone)
print("rounds run at each k:", result.stats["rounds_by_k"])
