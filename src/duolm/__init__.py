"""duolm: GPT-2 and BERT."""
