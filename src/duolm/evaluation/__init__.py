"""Zero-shot evaluation of causal language models, with the GPT-2 paper's protocols.

    from duolm.evaluation import evaluate_lm, run_suite, table3_markdown
    evaluate_lm(model, tok, "wikitext2", "wiki.test.tokens")   # {"ppl": ..., "protocol": "...", ...}

detok: invertible de-tokenizers; perplexity: sliding windows, streamed and batched, normalisers;
readers: the datasets' file formats; tasks: corpus perplexity, LAMBADA, CBT; prompted: summarize,
translate, CoQA by generation; choice: multiple choice as lm-evaluation-harness scores it (PIQA, ARC, COPA,
WSC, HellaSwag); suite: the entry point, Table 3, the zero-shot-mc suite and the published numbers.
"""
from duolm.evaluation.detok import detokenize, detokenize_words, retokenize
from duolm.evaluation.perplexity import (bits_per_unit, count_words, encode_stream, perplexity, score_stream,
                                         sliding_windows, windows)
from duolm.evaluation.prompted import coqa_f1, first_sentences
from duolm.evaluation.suite import (PAPER_TABLE3, TASKS, evaluate_lm, find_suite_files, markdown, run_suite,
                                    table3_markdown)
from duolm.evaluation.tasks import EvalOptions

__all__ = ["detokenize", "detokenize_words", "retokenize", "bits_per_unit", "count_words", "encode_stream",
           "perplexity", "score_stream", "sliding_windows", "windows", "coqa_f1", "first_sentences",
           "PAPER_TABLE3", "TASKS", "evaluate_lm", "find_suite_files", "markdown", "run_suite", "table3_markdown",
           "EvalOptions"]
