"""Data for pretraining: token shards (`prepare`), causal-LM windows, BERT pairs and masking."""
from duolm.data.causal import CausalBatches
from duolm.data.mlm import (
    IGNORE,
    BertBatches,
    Instance,
    MaskSpec,
    collate,
    create_instances_from_document,
    mask_tokens,
    masked_example,
    pack_full_sentences,
    truncate_seq_pair,
)
from duolm.data.prepare import prepare
from duolm.data.shards import load_documents, load_meta, open_split, read_shard, write_shard

__all__ = [
    "prepare", "load_meta", "open_split", "load_documents", "write_shard", "read_shard",
    "CausalBatches", "BertBatches", "MaskSpec", "Instance", "IGNORE", "collate", "create_instances_from_document",
    "mask_tokens", "masked_example", "pack_full_sentences", "truncate_seq_pair",
]
