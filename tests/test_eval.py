"""Zero-shot evaluation (the GPT-2 paper's protocol): window arithmetic, de-tokenizers, published word
counts, readers, and every score against an independent computation with transformers on the same
model (a tiny random GPT-2 saved in HF format and loaded by transformers)."""
import itertools
import json
import math
import random
import tracemalloc

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import duolm  # noqa: E402
from duolm.evaluation import (count_words, detokenize, encode_stream, evaluate_lm, retokenize,  # noqa: E402
                              run_suite, sliding_windows, table3_markdown, windows)
from duolm.evaluation.prompted import coqa_f1, first_sentences  # noqa: E402
from duolm.evaluation.readers import CBTExample, LambadaExample  # noqa: E402
from duolm import cli  # noqa: E402
from duolm.evaluation.tasks import STOPWORDS, cbt_scores, cbt_texts  # noqa: E402
from duolm.generation.static import _DECODERS, StaticDecoder  # noqa: E402
from duolm.models import GPT2, GPT2Config  # noqa: E402

REL = 1e-6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: a second thread only adds waits on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --- the model and tokenizer, in duolm and in transformers ---------------------------------------

@pytest.fixture(scope="module")
def tok(data_dir):
    return duolm.ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")


@pytest.fixture(scope="module")
def models(tok, tmp_path_factory):
    """(ours, transformers' GPT2LMHeadModel, transformers' tokenizer, the HF directory): same weights."""
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=50257, block_size=256, n_layer=2, n_head=2, n_embd=32))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():        # LayerNorms and biases away from 1 / 0 too
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.eval()
    d = duolm.save(model, tmp_path_factory.mktemp("tiny") / "hf", tokenizer=tok, format="hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(d).eval()
    hf_tok = transformers.GPT2TokenizerFast.from_pretrained(d)
    return model, hf, hf_tok, d


def hf_logprobs(hf, ids, start=0):
    """log-softmax of transformers' logits for one sequence, rows start.. (T - start, V)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, start:].float(), -1)


def hf_sliding_nll(hf, ids, block, stride):
    """HF's perplexity-guide loop, with two changes that make it score every token exactly once: each
    scored token's NLL is summed (the guide weights each window's mean loss by trg_len - 1 tokens, a
    slight mis-weighting past the first window), and a window starts at most one token before the
    previous one's end (with stride = block the guide leaves each window's first token unscored)."""
    nll, n, prev_end, begin = 0.0, 0, 0, 0
    while True:
        end = min(begin + block, len(ids))
        trg = min(end - prev_end, end - begin - 1)
        lp = hf_logprobs(hf, ids[begin:end], start=end - begin - 1 - trg)[:-1]    # rows of the scored tokens
        nll -= float(lp.gather(1, torch.tensor(ids[end - trg:end])[:, None]).double().sum())
        n += trg
        if end == len(ids):
            return nll, n
        prev_end, begin = end, min(begin + stride, end - 1)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


# --- window arithmetic --------------------------------------------------------------------------

def test_sliding_windows_worked_example_every_context_length():
    """10 tokens, block 4, stride 2: every token from 1 on is scored once, with this much context."""
    wins = sliding_windows(10, 4, 2)
    assert wins == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    context = {}
    for begin, end, first in wins:
        for p in range(first, end):
            assert p not in context
            context[p] = p - begin
    assert context == {1: 1, 2: 2, 3: 3, 4: 2, 5: 3, 6: 2, 7: 3, 8: 2, 9: 3}
    # stride = block: each window starts one token before the previous one's end, so its first
    # scored token has one token of context (HF's guide would leave tokens 4 and 8 unscored)
    assert sliding_windows(10, 4, 4) == [(0, 4, 1), (3, 7, 4), (6, 10, 7)]
    assert sliding_windows(1, 4, 2) == [] and sliding_windows(0, 4, 2) == []
    with pytest.raises(ValueError, match="stride"):
        sliding_windows(10, 4, 5)


def test_streamed_windows_score_every_token_once_for_any_chunking():
    rng = random.Random(0)
    for _ in range(300):
        n, block = rng.randrange(0, 60), rng.randrange(2, 12)
        stride = rng.randrange(1, block + 1)
        cuts = sorted(rng.sample(range(n + 1), min(n + 1, rng.randrange(0, 6))))
        chunks = [range(a, b) for a, b in zip([0] + cuts, cuts + [n])]
        scored, begins = [], []
        for ids, f, b in windows(chunks, block, stride):
            assert list(ids) == list(range(b, b + len(ids))) and 1 <= f < len(ids) <= block
            scored += range(b + f, b + len(ids))
            begins.append(b)
        assert scored == list(range(1, n)), (n, block, stride)
        # windows advance by the stride, except where that would leave a token without context
        assert all(b2 - b1 == min(stride, block - 1) for b1, b2 in zip(begins, begins[1:]))


def test_encode_stream_equals_encoding_the_whole_text(tok, data_dir):
    lines = list(itertools.islice(open(data_dir / "wikitext-2" / "test.txt", encoding="utf-8"), 400))
    text = "".join(lines)
    ids = [i for chunk in encode_stream(tok, lines, chunk_chars=2000) for i in chunk]
    assert ids == tok.encode_ordinary(text)
    one_line = " ".join(["anarchism originated as a term of abuse"] * 300)      # text8: no newline
    chunks = list(encode_stream(tok, [one_line[i:i + 777] for i in range(0, len(one_line), 777)], chunk_chars=1000))
    assert len(chunks) > 3 and [i for c in chunks for i in c] == tok.encode_ordinary(one_line)


def test_normalisers_worked_examples():
    from duolm.evaluation import bits_per_unit, perplexity
    assert perplexity(2 * math.log(4), 2) == pytest.approx(4.0)
    assert bits_per_unit(3 * math.log(2), 2) == pytest.approx(1.5)
    assert count_words([" a b \n", " \n", " = T = "]) == 3 + 1 + 4
    with pytest.raises(ValueError):
        perplexity(1.0, 0)


# --- de-tokenizers and word counts ------------------------------------------------------------------

def test_detokenizers_worked_examples():
    wt = ' He won 1 @,@ 000 @-@ odd votes ( 52 @.@ 5 % ) ; " a record " , Teddy \'s best . '
    assert detokenize(wt, "wikitext") == 'He won 1,000-odd votes (52.5 %); "a record", Teddy\'s best.'
    assert detokenize(" = = Early life = = ", "wikitext") == "== Early life =="
    assert detokenize(" ", "wikitext") == ""
    assert detokenize(" the company 's shares were n't sold ", "ptb") == "the company's shares weren't sold"
    books = "`` nineteen , '' she said . `` yes ! ''"
    assert detokenize(books, "books") == '"nineteen," she said. "yes!"'
    assert detokenize('He said , " I \'m fine . "', "1bw") == 'He said, "I\'m fine."'
    # a token that keeps its period stays apart from a following sentence period
    assert detokenize(" in the U.S. . Then ", "wikitext") == "in the U.S. . Then"
    for line, d in [(wt, "wikitext"), (books, "books"), (" in the U.S. . Then ", "wikitext")]:
        assert retokenize(detokenize(line, d), d) == line
    with pytest.raises(ValueError, match="framed"):
        detokenize("not framed", "wikitext")


@pytest.mark.parametrize("rel_path, dataset", [
    ("wikitext-2/test.txt", "wikitext"), ("wikitext-2/valid.txt", "wikitext"),
    ("wikitext-2-raw/wiki.test.raw", "wikitext"), ("ptb/ptb.test.txt", "ptb"),
    ("ptb/ptb.valid.txt", "ptb"), ("ptb/ptb.train.txt", "ptb")])
def test_detokenizer_is_invertible_on_every_line(data_dir, rel_path, dataset):
    lines = (data_dir / rel_path).read_text(encoding="utf-8").split("\n")[:-1]
    changed = 0
    for n, line in enumerate(lines, 1):
        text = detokenize(line, dataset)
        assert retokenize(text, dataset) == line, f"{rel_path} line {n}"
        changed += text != line
    assert changed > len(lines) * 0.9      # it does undo the tokenization


# Published token counts, one end-of-line token per line:
#  WikiText-2 / -103 valid 217,646 and test 245,569: Merity et al. 2016, "Pointer Sentinel Mixture
#  Models", Table 1 (the two datasets share their valid and test articles).
#  PTB train 929,589 / valid 73,760 / test 82,430: Mikolov's data counted with one <eos> per line, as
#  TensorFlow's and Chainer's PTB readers load it (Chainer get_ptb_words: arrays of 929,589 / 73,760 /
#  82,430 ids; Edward's observations.ptb doc: "929,589 training words, 73,760 validation words, and
#  82,430 test words"); the papers' rounded "929k / 73k / 82k".
@pytest.mark.parametrize("task, rel_path, words", [
    ("wikitext2", "wikitext-2/test.txt", 245_569), ("wikitext2", "wikitext-2/valid.txt", 217_646),
    ("wikitext2", "wikitext-2-raw/wiki.test.raw", 245_569),
    ("wikitext103", "wikitext-103/wiki.test.tokens", 245_569), ("wikitext103", "wikitext-103/wiki.valid.tokens", 217_646),
    ("ptb", "ptb/ptb.test.txt", 82_430), ("ptb", "ptb/ptb.valid.txt", 73_760), ("ptb", "ptb/ptb.train.txt", 929_589)])
def test_word_counts_used_as_normalisers_are_the_published_ones(data_dir, task, rel_path, words):
    from duolm.evaluation.readers import corpus_lines
    assert count_words(corpus_lines(data_dir / rel_path, task, framed=True)) == words


# --- protocol parity with transformers ----------------------------------------------------------------

@pytest.mark.parametrize("stride", [96, 256])
def test_perplexity_equals_transformers_sliding_window(models, tok, data_dir, stride):
    model, hf, hf_tok, _ = models
    lines = list(itertools.islice(open(data_dir / "wikitext-2" / "test.txt", encoding="utf-8"), 1, 12))
    got = evaluate_lm(model, tok, "wikitext2", lines, stride=stride, batch_size=3)
    text = "".join(detokenize(line[:-1], "wikitext") + "\n" for line in lines)
    ids = [tok.eot_id] + hf_tok(text)["input_ids"]
    nll, n = hf_sliding_nll(hf, ids, 256, stride)
    words = sum(len(line.split()) + 1 for line in lines)
    assert got["tokens"] == n == len(ids) - 1 and got["words"] == words      # every token once
    assert rel(got["nll"], nll) < REL
    assert rel(got["ppl"], math.exp(nll / words)) < REL
    assert f"stride {stride}" in got["protocol"] and "per word" in got["protocol"]
    if stride == 256:
        off = evaluate_lm(model, tok, "wikitext2", lines, stride=stride, detokenize=False)
        ref = hf_sliding_nll(hf, [tok.eot_id] + hf_tok("".join(lines))["input_ids"], 256, stride)[0]
        assert rel(off["nll"], ref) < REL and off["nll"] != got["nll"]


def test_bits_per_byte_and_per_char_equal_transformers(models, tok, data_dir, tmp_path):
    model, hf, hf_tok, _ = models
    raw = (data_dir / "wikitext-2-raw" / "wiki.test.raw").read_bytes()[:3000]
    raw = raw[:raw.rindex(b" ")] + " — ünïcode".encode()       # multi-byte characters count as bytes
    (tmp_path / "enwik8").write_bytes(raw)
    got = evaluate_lm(model, tok, "enwik8", tmp_path / "enwik8", stride=128)
    nll, _ = hf_sliding_nll(hf, [tok.eot_id] + hf_tok(raw.decode())["input_ids"], 256, 128)
    assert got["bytes"] == len(raw) and rel(got["bpb"], nll / (len(raw) * math.log(2))) < REL
    text8 = b"anarchism originated as a term of abuse first used against early working class radicals " * 8
    (tmp_path / "text8").write_bytes(text8)
    got = evaluate_lm(model, tok, "text8", tmp_path / "text8")
    nll, _ = hf_sliding_nll(hf, [tok.eot_id] + hf_tok(text8.decode())["input_ids"], 256, 128)
    assert got["chars"] == len(text8) and rel(got["bpc"], nll / (len(text8) * math.log(2))) < REL


def test_1bw_perplexity_equals_transformers(models, tok, tmp_path):
    model, hf, hf_tok, _ = models
    lines = ['He said , " I \'m fine . "', "The U.S. economy grew 3.5 % in the quarter , officials said .",
             "It was n't clear ( to anyone ) why ."]
    (tmp_path / "news.en.heldout-00000-of-00050").write_text("\n".join(lines) + "\n")
    got = evaluate_lm(model, tok, "1bw", tmp_path / "news.en.heldout-00000-of-00050")
    text = 'He said, "I\'m fine."\nThe U.S. economy grew 3.5 % in the quarter, officials said.\nIt wasn\'t clear (to anyone) why.\n'
    nll, n = hf_sliding_nll(hf, [tok.eot_id] + hf_tok(text)["input_ids"], 256, 128)
    assert got["words"] == 10 + 14 + 11 and got["tokens"] == n and rel(got["ppl"], math.exp(nll / 35)) < REL


def _hf_lambada(hf, hf_tok, examples, stop_ids=None):
    """A plain loop: per passage, the target's tokens after the context, greedy predictions."""
    nll, last_tok, last_word = 0.0, 0, 0
    for ex in examples:
        ctx, tgt = hf_tok(ex.context)["input_ids"], hf_tok(ex.target)["input_ids"]
        lp = hf_logprobs(hf, ctx + tgt[:-1], start=len(ctx) - 1)       # rows predicting the target
        pred = lp.argmax(-1).tolist()
        if stop_ids is not None:
            first = lp[0].clone()
            first[stop_ids] = -math.inf
            pred[0] = int(first.argmax())
        nll -= sum(float(lp[j, t]) for j, t in enumerate(tgt))
        last_tok += pred[-1] == tgt[-1]
        last_word += pred == tgt
    n = len(examples)
    return {"acc_last_token": 100 * last_tok / n, "acc_last_word": 100 * last_word / n, "ppl": math.exp(nll / n)}


@pytest.fixture(scope="module")
def lambada_examples(models, data_dir):
    """16 development passages; for 8 of them the target is made the model's own greedy word (one or
    two tokens), so that hits happen and both accuracies are tested."""
    model, hf, hf_tok, _ = models
    from duolm.evaluation.readers import lambada_examples as read
    exs = read(data_dir / "lambada" / "lambada_development_plain_text.txt")[:16]
    out = []
    for k, ex in enumerate(exs):
        if k % 2:
            ids = hf_tok(ex.context)["input_ids"]
            t1 = int(hf_logprobs(hf, ids, start=len(ids) - 1)[-1].argmax())
            t2 = int(hf_logprobs(hf, ids + [t1], start=len(ids))[-1].argmax())
            word = hf_tok.decode([t1] + ([t2] if k % 4 == 1 else []))
            ex = LambadaExample(ex.context, word if word.startswith(" ") else " " + word)
        out.append(ex)
    return out


def test_lambada_equals_a_plain_transformers_loop(models, tok, lambada_examples):
    model, hf, hf_tok, _ = models
    got = evaluate_lm(model, tok, "lambada", lambada_examples, batch_size=5)
    ref = _hf_lambada(hf, hf_tok, lambada_examples)
    assert got["examples"] == 16
    assert got["acc_last_token"] == ref["acc_last_token"] and got["acc_last_token"] > 0
    assert got["acc_last_word"] == ref["acc_last_word"]
    assert rel(got["ppl"], ref["ppl"]) < REL
    # stop-word filter: the first token of the predicted word may not be a stop word
    stop = [i for i in range(tok.vocab_size) if hf_tok.decode([i]).strip().lower() in STOPWORDS]
    exs = lambada_examples + [LambadaExample(ex.context, " the") for ex in lambada_examples[:6]]
    got = evaluate_lm(model, tok, "lambada", exs, stopword_filter=True)
    ref = _hf_lambada(hf, hf_tok, exs, torch.tensor(stop))
    assert (got["acc_last_token"], got["acc_last_word"]) == (ref["acc_last_token"], ref["acc_last_word"])
    assert "stop-word filter on" in got["protocol"]


def test_lambada_readers_jsonl_and_plain_text(tmp_path, data_dir):
    from duolm.evaluation.readers import lambada_examples as read
    (tmp_path / "lambada_test.jsonl").write_text(
        json.dumps({"text": 'He said, "Go home," and left Tom'}) + "\n" + json.dumps({"text": "a b"}) + "\n")
    assert read(tmp_path / "lambada_test.jsonl") == [LambadaExample('He said, "Go home," and left', " Tom"),
                                                     LambadaExample("a", " b")]
    plain = read(data_dir / "lambada" / "lambada_development_plain_text.txt")
    assert len(plain) == 4869 and plain[0].target == " cake"
    raw = read(data_dir / "lambada" / "lambada_development_plain_text.txt", detokenize=False)
    assert raw[1].context.startswith("`` nineteen , ''") and plain[1].context.startswith('"nineteen,"')


def _write_cbt(path, examples):
    lines = []
    for context, question, answer, cands in examples:
        lines += [f"{i} {s}" for i, s in enumerate(context, 1)]
        lines += [f"21 {question}\t{answer}\t\t{'|'.join(cands)}", ""]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def cbt_file(data_dir, tmp_path_factory):
    """Two CBT examples in the distributed format, sentences taken from the LAMBADA development text."""
    text = (data_dir / "lambada" / "lambada_development_plain_text.txt").read_text(encoding="utf-8").replace("\n", " ")
    sents = [s.strip() + " ." for s in text.split(" . ")[:60] if s.strip()]
    cands = "alex|brian|claire|dad|helen|max|pam|rowan|shane|tom".split("|")
    exs = [(sents[:20], "`` where is XXXXX , '' she asked .", "max", cands),
           (sents[20:40], "XXXXX went to the restroom to freshen up .", "claire", cands[::-1])]
    path = tmp_path_factory.mktemp("cbt") / "cbtest_CN_test_2500ex.txt"
    _write_cbt(path, exs)
    return path


def test_cbt_equals_a_plain_transformers_loop(models, tok, cbt_file):
    model, hf, hf_tok, _ = models
    from duolm.evaluation.readers import cbt_examples
    exs = cbt_examples(cbt_file, "cbt-cn")
    assert len(exs) == 2 and len(exs[0].context) > 200          # longer than the 256-token window
    hits = 0
    for ex in exs:
        ours = cbt_scores(model, tok, ex, detok=True)
        ref = []
        for cand in ex.candidates:
            prefix, scored = cbt_texts(ex, cand, True)
            p, c = hf_tok(prefix)["input_ids"], hf_tok(scored)["input_ids"]
            p = p[-(256 + 1 - max(len(hf_tok(cbt_texts(ex, x, True)[1])["input_ids"]) for x in ex.candidates)):]
            lp = hf_logprobs(hf, p + c[:-1], start=len(p) - 1)
            ref.append(sum(float(lp[j, t]) for j, t in enumerate(c)))
        assert all(rel(a, b) < REL for a, b in zip(ours, ref))
        hits += ex.candidates[ref.index(max(ref))] == ex.answer
    got = evaluate_lm(model, tok, "cbt-cn", cbt_file)
    assert got["acc"] == 100 * hits / 2 and got["examples"] == 2


def test_cbt_texts_fill_the_blank():
    ex = CBTExample(["she", "ran", "."], ["``", "where", "is", "XXXXX", ",", "''", "she", "asked", "."], "max",
                    ["max", "tom"])
    assert cbt_texts(ex, "tom", True) == ('she ran. "where is', ' tom," she asked.')
    assert cbt_texts(ex, "tom", False) == ("she ran . `` where is", " tom , '' she asked .")
    first = CBTExample(["it", "ends", "."], ["XXXXX", "ran", "."], "x", ["x", "y"])
    assert cbt_texts(first, "y", True) == ("it ends.", " y ran.")


# --- prompted tasks -------------------------------------------------------------------------------------

def test_first_sentences_and_coqa_f1_worked_examples():
    assert first_sentences(" He won. She lost! Then? They left.\n\nMore", 3) == "He won. She lost! Then?"
    assert first_sentences("No end in sight", 3) == "No end in sight"
    assert coqa_f1("a white cat", ["white cat", "the white cat", "a cat"]) == 1.0
    # leave-one-out: vs "cat" alone F1 0; vs "white cat" alone F1 2/3 -> mean 1/3
    assert coqa_f1("white", ["white cat", "cat"]) == pytest.approx(1 / 3)
    # one gold: precision 1/3, recall 1/2 -> F1 0.4 (punctuation and articles dropped)
    assert coqa_f1("The red, big dog!", ["a red cat"]) == pytest.approx(0.4)
    assert coqa_f1("", ["unknown"]) == 0.0 and coqa_f1("", [""]) == 1.0


def _hf_greedy_line(hf, ids, max_new, eot):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eot,
                      pad_token_id=eot, attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    return out[:out.index(eot)] if eot in out else out


def test_translate_equals_transformers_greedy_and_sacrebleu(models, tok, data_dir):
    sacrebleu = pytest.importorskip("sacrebleu")
    model, hf, hf_tok, _ = models
    en = (data_dir / "wmt14" / "newstest2014-fren.en.txt").read_text(encoding="utf-8").split("\n")[:5]
    fr = (data_dir / "wmt14" / "newstest2014-fren.fr.txt").read_text(encoding="utf-8").split("\n")[:5]
    got = evaluate_lm(model, tok, "translate", data_dir / "wmt14" / "newstest2014-fren.en.txt", shots=2,
                      max_examples=3, batch_size=2)
    head = f"{en[0]} = {fr[0]}\n{en[1]} = {fr[1]}\n"
    hyps = []
    for s in en[2:]:
        ids = hf_tok(f"{head}{s} =")["input_ids"][-(256 - 128):]
        text = hf_tok.decode(_hf_greedy_line(hf, ids, 128, tok.eot_id)).split("\n")[0]
        hyps.append(first_sentences(text, 1))
    assert got["predictions"] == hyps
    assert got["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [fr[2:]]).score)
    back = evaluate_lm(model, tok, "translate", data_dir / "wmt14" / "newstest2014-fren.fr.txt", shots=2,
                       max_examples=1, direction="fr-en")
    assert back["examples"] == 1 and "fr-en" in back["protocol"]


def test_coqa_equals_transformers_greedy(models, tok, tmp_path):
    model, hf, hf_tok, _ = models
    story = "Tom had a white cat called Snow. The cat slept in a basket by the fire. " * 12
    data = {"version": "1.0", "data": [{
        "id": "x", "source": "mctest", "story": story,
        "questions": [{"input_text": "What did Tom have?", "turn_id": 1}, {"input_text": "Where?", "turn_id": 2}],
        "answers": [{"input_text": "a white cat", "span_text": "", "turn_id": 1},
                    {"input_text": "in a basket", "span_text": "", "turn_id": 2}],
        "additional_answers": {"0": [{"input_text": "a cat"}, {"input_text": "by the fire"}]}}]}
    (tmp_path / "coqa.json").write_text(json.dumps(data))
    got = evaluate_lm(model, tok, "coqa", tmp_path / "coqa.json")
    prompts = [f"{story}\n\nQ: What did Tom have?\nA:", f"{story}\n\nQ: What did Tom have?\nA: a white cat\n\nQ: Where?\nA:"]
    preds = [hf_tok.decode(_hf_greedy_line(hf, hf_tok(p)["input_ids"][-(256 - 32):], 32, tok.eot_id)).split("\n")[0].strip()
             for p in prompts]
    assert got["predictions"] == preds
    _DECODERS[model] = StaticDecoder(model, compile=False)     # compile=True's route: the static step, uncompiled
    assert evaluate_lm(model, tok, "coqa", tmp_path / "coqa.json", compile=True)["predictions"] == preds
    assert _DECODERS.pop(model).built == 1                     # both questions' prompts in one bucket
    f1 = (coqa_f1(preds[0], ["a white cat", "a cat"]) + coqa_f1(preds[1], ["in a basket", "by the fire"])) / 2
    assert got["f1"] == pytest.approx(100 * f1)


def test_summarize_is_reproducible_and_scores_rouge_with_references(models, tok, data_dir, tmp_path):
    rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")
    model, *_ = models
    articles = (data_dir / "cnndm" / "test.source").read_text(encoding="utf-8").split("\n")[:2]
    assert all(len(tok.encode_ordinary(a)) > 256 for a in articles)      # cut to fit the window
    (tmp_path / "test.source").write_text("\n".join(articles) + "\n")
    a = evaluate_lm(model, tok, "summarize", tmp_path / "test.source", seed=3)
    assert "rouge1" not in a and "not computed" in a["protocol"] and len(a["predictions"]) == 2
    refs = ["A man won the race.", "The cat sat on the mat."]
    (tmp_path / "test.target").write_text("\n".join(refs) + "\n")
    c = evaluate_lm(model, tok, "summarize", tmp_path / "test.source", seed=3)
    assert c["predictions"] == a["predictions"]                            # the seed fixes the samples
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    ref = [scorer.score(r, s) for r, s in zip(refs, c["predictions"])]
    for name in ("rouge1", "rouge2", "rougeL"):
        assert c[name] == pytest.approx(100 * sum(x[name].fmeasure for x in ref) / 2)


# --- the suite and Table 3 -------------------------------------------------------------------------------

def test_suite_runs_what_is_there_and_prints_table3(models, tok, tmp_path, data_dir, cbt_file):
    model, *_ = models
    (tmp_path / "ptb").mkdir()
    (tmp_path / "ptb" / "ptb.test.txt").write_text("".join(open(data_dir / "ptb" / "ptb.test.txt").readlines()[:30]))
    (tmp_path / "cbtest_CN_test_2500ex.txt").write_bytes(cbt_file.read_bytes())
    calls = []
    suite = run_suite(model, tok, tmp_path, on_progress=lambda task, done, total, m: calls.append(task))
    assert set(suite["results"]) == {"ptb", "cbt-cn"} and set(calls) == {"ptb", "cbt-cn"}
    table = table3_markdown(suite).split("\n")
    assert table[0].startswith("| | LAMBADA (PPL) | LAMBADA (ACC)") and "| 117M (paper) | 35.13 | 45.99" in table[3]
    ours = table[-1].split(" | ")
    assert ours[0] == "| ours" and ours[6] == f"{suite['results']['ptb']['ppl']:.2f}" and ours[1] == "-"


def test_paper_numbers_for_released_sizes():
    from types import SimpleNamespace

    from duolm.evaluation.suite import model_size, paper_number
    assert model_size(SimpleNamespace(config=GPT2Config(n_layer=12, n_embd=768, n_head=12))) == "117M"
    assert model_size(SimpleNamespace(config=GPT2Config(n_layer=12, n_embd=768, n_head=12, block_size=512))) is None
    assert paper_number("wikitext2", "117M") == ("ppl", 29.41)
    assert paper_number("lambada", "1542M") == ("acc_last_token", 63.24)
    assert paper_number("enwik8", "762M") == ("bpb", 0.97) and paper_number("ptb", None) is None


# --- bad input ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task, content, line", [
    ("wikitext2", '{"text": "a b"}\n', 1),
    ("ptb", " a b \nno frame\n", 2),
    ("1bw", "A sentence .\n\nAnother .\n", 2),
    ("lambada", "1 a sentence here\n2 another\n\n", 3),
    ("lambada", '{"text": "a b"}\n{"story": 1}\n', 2),
    ("cbt-cn", " = Title = \n", 1),
    ("cbt-cn", "".join(f"{i} s .\n" for i in range(1, 21)) + "21 q XXXXX .\tans\t\ta|b\n", 21),
    ("text8", "abc def\nGHI\n", 2),
    ("enwik8", "12 34 56 78\n90 12\n", 1),
    ("coqa", '{"data": [\n  {"story": "x",\n', 3),
])
def test_a_file_of_the_wrong_format_names_task_file_and_line(models, tok, tmp_path, task, content, line):
    path = tmp_path / "data.txt"
    path.write_text(content)
    with pytest.raises(ValueError) as e:
        evaluate_lm(models[0], tok, task, path)
    msg = str(e.value)
    assert msg.startswith(f"{task}: {path}") and f"line {line}" in msg, msg


@pytest.mark.parametrize("task", ["wikitext2", "ptb", "1bw", "enwik8", "text8", "lambada", "cbt-ne", "coqa",
                                  "summarize", "translate"])
def test_an_empty_file_is_an_error(models, tok, tmp_path, task):
    path = tmp_path / "data.en.txt"
    path.write_text("")
    (tmp_path / "data.fr.txt").write_text("")
    with pytest.raises(ValueError, match=f"^{task}: .* is empty"):
        evaluate_lm(models[0], tok, task, path)


def test_other_bad_inputs(models, tok, tmp_path):
    model = models[0]
    bert = duolm.Bert(duolm.BertConfig.preset("tiny"))
    with pytest.raises(ValueError, match="wikitext2 needs a causal language model .*Bert.*masked"):
        evaluate_lm(bert, tok, "wikitext2", [" a "])
    with pytest.raises(ValueError, match="unknown task"):
        evaluate_lm(model, tok, "squad", "x")
    with pytest.raises(ValueError, match="unknown option"):
        evaluate_lm(model, tok, "ptb", [" a "], strid=3)
    small = GPT2(GPT2Config.preset("tiny"))        # 512 tokens: not the 50,257 of the tokenizer
    with pytest.raises(ValueError, match="do not belong together"):
        evaluate_lm(small, tok, "ptb", [" a "])
    with pytest.raises(FileNotFoundError):
        evaluate_lm(model, tok, "ptb", tmp_path / "missing.txt")
    (tmp_path / "x.en.txt").write_text("a\nb\n")
    (tmp_path / "x.fr.txt").write_text("a\n")
    with pytest.raises(ValueError, match="aligned"):
        evaluate_lm(model, tok, "translate", tmp_path / "x.en.txt")


def test_a_long_document_is_streamed(tmp_path):
    """Scoring memory does not grow with the document: 4x the text, about the same peak of Python
    allocations (no token list of the whole text is ever built)."""
    text = (" the quick brown fox jumps over the lazy dog , and the cat sleeps . \n" * 40)
    bpe = duolm.ByteLevelBPE.train([text], vocab_size=300)
    model = GPT2(GPT2Config(vocab_size=bpe.vocab_size, block_size=32, n_layer=1, n_head=1, n_embd=8)).eval()
    peaks = []
    for copies in (1, 4):
        path = tmp_path / f"wiki{copies}.tokens"
        path.write_text(text * 60 * copies)                              # 170 KB, 680 KB
        tracemalloc.start()
        got = evaluate_lm(model, bpe, "wikitext103", path, batch_size=64, detokenize=False)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert got["words"] == 16 * 40 * 60 * copies
    assert peaks[1] < 1.5 * peaks[0], peaks


# --- the command line -------------------------------------------------------------------------------------

def test_cli_eval_prints_metric_protocol_and_writes_json_and_markdown(models, tok, tmp_path, data_dir, capsys):
    model, _, _, d = models
    ptb = tmp_path / "ptb.test.txt"
    ptb.write_text("".join(open(data_dir / "ptb" / "ptb.test.txt").readlines()[:20]))
    cli.main(["eval", str(d), "--task", "ptb", "--data", str(ptb), "--stride", "200", "--json", "--compile"])
    got, err = json.loads((r := capsys.readouterr()).out), r.err
    assert "compiled" not in err                       # --compile decodes; perplexity does not: nothing compiled
    ref = evaluate_lm(model, tok, "ptb", ptb, stride=200)
    assert got == pytest.approx(ref) and "stride 200" in got["protocol"]
    cli.main(["eval", str(d), "--task", "ptb", "--data", str(ptb), "--no-detokenize", "-o", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert "ptb de-tokenizer off" in saved["protocol"] and f"| ppl | {saved['ppl']:.2f} |" in out
    assert (tmp_path / "r.md").read_text().startswith("| ptb | ours | paper |")
    (tmp_path / "suite" / "ptb").mkdir(parents=True)
    (tmp_path / "suite" / "ptb" / "ptb.test.txt").write_bytes(ptb.read_bytes())
    cli.main(["eval", str(d), "--suite", "gpt2-paper", "--data-dir", str(tmp_path / "suite")])
    out = capsys.readouterr().out
    assert "| 1542M (paper) | 8.63 |" in out and "ptb: window 256 tokens" in out


@pytest.mark.parametrize("argv, named", [
    (["--task", "ptb", "--data", "DATA"], ["needs a causal language model", "Bert"]),
    (["--task", "ptb"], ["--task TASK --data PATH"]),
    (["--task", "lambada", "--data", "WT"], ["lambada: ", "line 1"]),
])
def test_cli_eval_bad_input_is_one_line(models, tok, tmp_path, data_dir, capsys, argv, named):
    bert_dir = duolm.save(duolm.BertForPreTraining(duolm.BertConfig.preset("tiny")), tmp_path / "bert")
    (tmp_path / "wt.txt").write_text(" \n = Title = \n")
    model_dir = str(bert_dir) if "DATA" in argv else str(models[3])
    argv = [{"DATA": str(tmp_path / "wt.txt"), "WT": str(tmp_path / "wt.txt")}.get(a, a) for a in argv]
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", model_dir] + argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("duolm: error:")
    assert all(n in err for n in named), err
