"""GPT-2 and BERT as plain torch modules (no file I/O, no tokenizers)."""
from duolm.models.bert import Bert, BertConfig, BertForPreTraining, BertMLMHead, BertNSPHead
from duolm.models.gpt2 import GPT2, GPT2Config, KVCache

__all__ = ["GPT2Config", "GPT2", "KVCache", "BertConfig", "Bert", "BertForPreTraining",
           "BertMLMHead", "BertNSPHead"]
