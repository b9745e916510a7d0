"""Zero-shot evaluation of causal language models (the GPT-2 paper's protocol)."""
