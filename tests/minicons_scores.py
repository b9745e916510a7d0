"""Run by tests/test_scoring.py in a subprocess (minicons needs transformers < 5: .venv/qa-reference's, with
.venv/minicons-reference first on PYTHONPATH): argv = sentences.json jobs.json, each job [model_dir, kind, pll or
null]; prints, for each job, each sentence's summed log-probability (one JSON list of lists), minicons' way
(reduction sum; GPT-2 with bos_token=True), 20 sentences a call (it computes every position's logits of every masked
copy). One process for every job: minicons' import takes seconds."""
import json
import sys
import warnings

warnings.filterwarnings("ignore")
from minicons import scorer  # noqa: E402

sentences, jobs = (json.loads(open(path).read()) for path in sys.argv[1:3])
total = lambda x: x.sum(0).item()                     # noqa: E731
out = []
for model_dir, kind, pll in jobs:
    if kind == "gpt2":
        lm = scorer.IncrementalLMScorer(model_dir, "cpu")
        score = lambda batch: lm.sequence_score(batch, reduction=total, bos_token=True)            # noqa: E731
    else:                                             # sequence_score takes the metric itself (not the constructor's)
        lm = scorer.MaskedLMScorer(model_dir, "cpu")
        score = lambda batch: lm.sequence_score(batch, reduction=total, PLL_metric=pll)            # noqa: E731
    out.append([s for i in range(0, len(sentences), 20) for s in score(sentences[i:i + 20])])
print(json.dumps(out))
