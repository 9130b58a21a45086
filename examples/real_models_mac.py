"""Real models on an Apple-silicon Mac (downloads about 5 GB from the Hugging Face Hub).

    python examples/real_models_mac.py

A 4-bit Qwen2.5 7B target with the 0.5B model of the same family as draft:
both share one tokenizer, which is what speculative decoding needs.
"""

from mlx_spec import generate, load

target_model, tokenizer = load("mlx-community/Qwen2.5-7B-Instruct-4bit")
draft_model, _ = load("mlx-community/Qwen2.5-0.5B-Instruct-4bit")

messages = [{"role": "user", "content": "Write a Python function that merges two sorted lists."}]
prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
generate(target_model, tokenizer, prompt, draft_model=draft_model, max_tokens=300,
         adaptive=True, verbose=True)
