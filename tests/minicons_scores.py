"""Run by tests/test_scoring.py in a subprocess (minicons needs transformers < 5: .venv/qa-reference's, with
.venv/minicons-reference first on PYTHONPATH): argv = model_dir kind sentences.json [pll]; prints each sentence's
summed log-probability as JSON, minicons' way (reduction sum; GPT-2 with bos_token=True), 20 sentences a call (it
computes every position's logits of every masked copy)."""
import json
import sys
import warnings

warnings.filterwarnings("ignore")
from minicons import scorer  # noqa: E402

model_dir, kind, path = sys.argv[1:4]
sentences = json.loads(open(path).read())
total = lambda x: x.sum(0).item()                     # noqa: E731
if kind == "gpt2":
    lm = scorer.IncrementalLMScorer(model_dir, "cpu")
    score = lambda batch: lm.sequence_score(batch, reduction=total, bos_token=True)            # noqa: E731
else:                                                 # sequence_score takes the metric itself (not the constructor's)
    lm = scorer.MaskedLMScorer(model_dir, "cpu")
    score = lambda batch: lm.sequence_score(batch, reduction=total, PLL_metric=sys.argv[4])    # noqa: E731
print(json.dumps([s for i in range(0, len(sentences), 20) for s in score(sentences[i:i + 20])]))
