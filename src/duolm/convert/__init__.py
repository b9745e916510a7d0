"""Foreign formats at the border: name tables between duolm and HF transformers state dicts."""
from duolm.convert.hf import (bert_config_from_hf, bert_config_to_hf, bert_from_hf, bert_to_hf,
                              config_from_hf, gpt2_config_from_hf, gpt2_config_to_hf, gpt2_from_hf,
                              gpt2_to_hf)

__all__ = ["gpt2_config_from_hf", "gpt2_config_to_hf", "gpt2_from_hf", "gpt2_to_hf",
           "bert_config_from_hf", "bert_config_to_hf", "bert_from_hf", "bert_to_hf", "config_from_hf"]
