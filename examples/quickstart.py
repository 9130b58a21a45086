"""Speculative decoding with the shipped default pair, and the same text without it.

    python examples/quickstart.py
"""

from mlx_spec import generate, load_default_pair

target_model, draft_model, tokenizer = load_default_pair()
prompt = "def fibonacci(n):"

plain = generate(target_model, tokenizer, prompt, max_tokens=100, prompt_lookup=False)
text = generate(target_model, tokenizer, prompt, draft_model=draft_model, max_tokens=100,
                num_draft_tokens=4, verbose=True)
print("identical to the target alone:", text == plain)
