"""sentence-transformers' files beside a Hugging Face model: how its token states become one vector.

    modules.json                [Transformer "", Pooling "1_Pooling", Normalize "2_Normalize" (when normalised)]
    1_Pooling/config.json       word_embedding_dimension, pooling_mode_mean_tokens / pooling_mode_cls_token, ...
    sentence_bert_config.json   max_seq_length, do_lower_case

read_pooling reads what a checkpoint was trained with; write_pooling writes the files `SentenceTransformer(path)`
loads (duolm.checkpoint.save of an embedding model, format "hf").
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from duolm.fileio import read_json, write_json

ST_MODULES = "modules.json"                  # sentence-transformers' module list
ST_POOLING = "1_Pooling/config.json"         # its default pooling folder
ST_CONFIG = "sentence_bert_config.json"      # holds max_seq_length
MODES = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
               "pooling_mode_lasttoken")


@dataclass(frozen=True)
class Pooling:
    """How token states become one vector: "mean" over real tokens or the "cls" state, then an L2
    normalisation when `normalize`. max_length: longest input in tokens ([CLS] and [SEP] included),
    None = the model's block_size. source: the file it was read from (None: the default)."""

    mode: str = "cls"
    normalize: bool = True
    max_length: int | None = None
    source: str | None = None


def read_pooling(model_dir, default: Pooling = Pooling()) -> Pooling:
    """The pooling a checkpoint was trained with, from its sentence-transformers files: modules.json
    names the pooling folder (default 1_Pooling/) and whether a Normalize module follows;
    sentence_bert_config.json gives max_seq_length. Without those files: `default` ([CLS], normalised: unit
    vectors, as OpenAI's embeddings are). Pooling modes other than mean and cls are refused."""
    d = Path(model_dir)
    pooling_file, normalize = d / ST_POOLING, True
    if (d / ST_MODULES).is_file():
        modules = read_json(d / ST_MODULES, kind=list)
        types = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules if isinstance(m, dict)}
        if "Pooling" in types:
            pooling_file = d / types["Pooling"] / "config.json"
        normalize = "Normalize" in types
    if not pooling_file.is_file():
        return default
    cfg = read_json(pooling_file)
    modes = sorted(k[len("pooling_mode_"):] for k, v in cfg.items() if k.startswith("pooling_mode_") and v)
    mode = {"mean_tokens": "mean", "cls_token": "cls"}.get(modes[0]) if len(modes) == 1 else None
    if mode is None:
        raise ValueError(f"{pooling_file}: pooling {modes or 'none'} is not supported; duolm serves "
                         "pooling_mode_mean_tokens or pooling_mode_cls_token")
    max_length = None
    if (d / ST_CONFIG).is_file():
        max_length = read_json(d / ST_CONFIG).get("max_seq_length")
    return Pooling(mode, normalize, max_length, str(pooling_file.relative_to(d)))


def write_pooling(path, pooling: Pooling, dim: int) -> None:
    """modules.json, 1_Pooling/config.json and sentence_bert_config.json of a model whose HF files are in `path`
    (as sentence-transformers 5 and 6 write them)."""
    path = Path(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if pooling.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "1_Pooling").mkdir(exist_ok=True)
    write_json(path / ST_POOLING, {"word_embedding_dimension": dim, **{v: k == pooling.mode for k, v in MODES.items()},
                                   **dict.fromkeys(OTHER_MODES, False), "include_prompt": True})
    write_json(path / ST_CONFIG, {"max_seq_length": pooling.max_length, "do_lower_case": False})
    write_json(path / ST_MODULES, modules)
