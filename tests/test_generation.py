"""Generation: sampling filters (worked examples + transformers' processors), KV-cached decoding
against full recompute, greedy / beam / sampling against transformers' generate on the same tiny
random weights, batching, stops, the context window, BERT fill-mask, TextStream."""
import math

import pytest
import torch

from duolm.convert.hf import bert_config_to_hf, bert_to_hf, gpt2_config_to_hf, gpt2_to_hf
from duolm.generation import (StopReason, apply_repetition_penalty, apply_temperature, beam_search, fill_mask,
                              generate, next_token, top_k_filter, top_p_filter)
from duolm.textgen import TextStream
from duolm.models import GPT2, BertConfig, BertForPreTraining, GPT2Config, KVCache

transformers = pytest.importorskip("transformers")
INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# fixtures: a tiny GPT-2 and the same weights in transformers

def _tiny_config(**kw):
    return GPT2Config(**{**dict(vocab_size=97, block_size=48, n_layer=2, n_head=2, n_embd=32), **kw})


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    cfg = _tiny_config()
    ours = GPT2(cfg).eval()
    # larger weights than the N(0, 0.02) init so the next-token distributions are far from uniform
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    hf_cfg = transformers.GPT2Config(**{k: v for k, v in gpt2_config_to_hf(cfg).items()
                                        if k not in ("model_type", "architectures")})
    hf_cfg.bos_token_id = hf_cfg.eos_token_id = hf_cfg.pad_token_id = None
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    hf.load_state_dict(gpt2_to_hf(ours.state_dict()))
    return ours, hf


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 1, 9, 3)]


def _collect(gen, n):
    out = [[] for _ in range(n)]
    for step in gen:
        for i, t in enumerate(step):
            if t is not None:
                out[i].append(t)
    return out


def _hf_generate(hf, prompt, **kw):
    ids = torch.tensor([prompt])
    kw.setdefault("pad_token_id", 0)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    return out[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------------------------
# sampling filters: worked examples

def test_repetition_penalty_worked_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    # seen positive logit / 2, seen negative logit * 2, unseen untouched
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, 3.0]]
    assert apply_repetition_penalty(logits, seen, 1.0) is logits


def test_temperature_worked_example():
    assert apply_temperature(torch.tensor([1.0, 2.0, -3.0]), 0.5).tolist() == [2.0, 4.0, -6.0]
    with pytest.raises(ValueError, match="greedy"):
        apply_temperature(torch.tensor([1.0]), 0.0)


def test_top_k_worked_example():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    assert top_k_filter(logits, 2).tolist() == [[INF, 3.0, 2.0, INF, INF]]
    assert top_k_filter(logits, 5).tolist() == logits.tolist()
    # ties with the k-th largest are kept
    assert top_k_filter(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), 1).tolist() == [[INF, 2.0, 2.0, INF]]
    with pytest.raises(ValueError):
        top_k_filter(logits, 0)


def test_top_p_worked_example():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    keep = lambda p: torch.isfinite(top_p_filter(logits, p)).tolist()[0]
    # cumulative mass from the top: 0.5, 0.8, 0.95, 1.0 -> the smallest head reaching p stays
    assert keep(0.4) == [True, False, False, False]
    assert keep(0.75) == [True, True, False, False]
    assert keep(0.9) == [True, True, True, False]
    assert keep(1.0) == [True, True, True, True]
    # a single dominant token is always kept, even for tiny p
    assert keep(0.01) == [True, False, False, False]


def test_filters_equal_transformers_processors():
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    prev = torch.randint(0, 50, (4, 7), generator=g)
    seen = torch.zeros(4, 50, dtype=torch.bool).scatter_(1, prev, True)
    assert torch.equal(apply_repetition_penalty(logits, seen, 1.3),
                       RepetitionPenaltyLogitsProcessor(1.3)(prev, logits.clone()))
    for k in (1, 5, 49):
        assert torch.equal(top_k_filter(logits, k), TopKLogitsWarper(k)(prev, logits.clone()))
    for p in (0.1, 0.5, 0.9, 0.99):
        assert torch.equal(top_p_filter(logits, p), TopPLogitsWarper(p)(prev, logits.clone()))


def test_next_token_greedy_and_seeded_sampling():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 2.9]])
    assert next_token(logits, temperature=0).tolist() == [1, 0]
    assert next_token(logits, temperature=1.0, top_k=1).tolist() == [1, 0]
    logits = torch.randn(3, 40)
    draw = lambda seed: [next_token(logits, 1.0, generator=torch.Generator().manual_seed(seed)).tolist()
                         for _ in range(1)]
    assert draw(0) == draw(0)
    many = {tuple(next_token(logits, 1.0, generator=torch.Generator().manual_seed(s)).tolist()) for s in range(8)}
    assert len(many) > 1


# ---------------------------------------------------------------------------------------------
# the KV cache against full recompute

def test_cached_logits_equal_recompute(pair):
    model, _ = pair
    prompts = _prompts()
    steps = 12
    greedy = _collect(generate(model, prompts, steps, temperature=0), len(prompts))
    with torch.no_grad():
        for p, new in zip(prompts, greedy):
            seq = p + new
            full = model(torch.tensor([seq]))[0]                           # recompute, no cache
            cache = KVCache(model.config, 1)
            logits = [model(torch.tensor([p]), cache=cache)[0, -1]]
            for t in new[:-1]:
                logits.append(model(torch.tensor([[t]]), cache=cache)[0, -1])
            cached = torch.stack(logits)
            torch.testing.assert_close(cached, full[len(p) - 1:len(seq) - 1], rtol=0, atol=1e-5)
            # greedy through generate() equals argmax of the recomputed logits
            assert full[len(p) - 1:len(seq) - 1].argmax(-1).tolist() == new


def test_left_padded_cached_logits_equal_unpadded(pair):
    model, _ = pair
    prompts = _prompts()
    P = max(map(len, prompts))
    idx = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    nxt = torch.tensor([[3], [5], [7], [11]])
    with torch.no_grad():
        cache = KVCache(model.config, len(prompts))
        model(idx, attention_mask=mask, cache=cache)
        step = model(nxt, attention_mask=torch.cat([mask, torch.ones(4, 1, dtype=torch.long)], 1), cache=cache)
        for i, p in enumerate(prompts):
            alone = model(torch.tensor([p + nxt[i].tolist()]))[0, -1]
            torch.testing.assert_close(step[i, -1], alone, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# greedy, sampling and beams against transformers

def test_greedy_equals_transformers(pair):
    model, hf = pair
    for p in _prompts():
        ours = _collect(generate(model, [p], 20, temperature=0), 1)[0]
        assert ours == _hf_generate(hf, p, max_new_tokens=20, do_sample=False)


def test_greedy_with_eos_and_repetition_penalty_equals_transformers(pair):
    model, hf = pair
    p = _prompts()[0]
    free = _collect(generate(model, [p], 20, temperature=0, repetition_penalty=1.5), 1)[0]
    eos = free[6]
    gen = generate(model, [p], 20, temperature=0, repetition_penalty=1.5, stop=[[eos]])
    ours = _collect(gen, 1)[0]
    assert ours == free[:free.index(eos) + 1]
    assert gen.stop_reasons == [StopReason.STOP]
    assert ours == _hf_generate(hf, p, max_new_tokens=20, do_sample=False, repetition_penalty=1.5,
                                eos_token_id=eos)


def test_sampling_equals_transformers_with_the_same_seed(pair):
    # transformers draws with torch.multinomial from the global RNG; with generator=None we do too,
    # so after the same manual_seed the same filters must give the same ids.
    model, hf = pair
    p = _prompts()[2]
    kw = dict(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.2)
    torch.manual_seed(123)
    ours = _collect(generate(model, [p], 25, **kw), 1)[0]
    torch.manual_seed(123)
    theirs = _hf_generate(hf, p, max_new_tokens=25, do_sample=True, **kw)
    assert ours == theirs
    g = lambda: torch.Generator().manual_seed(7)
    a = _collect(generate(model, [p], 25, temperature=1.0, generator=g()), 1)[0]
    b = _collect(generate(model, [p], 25, temperature=1.0, generator=g()), 1)[0]
    assert a == b and a != ours


@pytest.mark.parametrize("num_beams,length_penalty,early_stopping", [
    (3, 1.0, False), (4, 0.5, False), (3, 2.0, True), (2, 1.0, "never")])
def test_beam_search_equals_transformers(pair, num_beams, length_penalty, early_stopping):
    model, hf = pair
    for j, p in enumerate(_prompts()[1:3], start=1):
        # an eos the beams actually meet: a token greedy produces a few steps in
        eos = _collect(generate(model, [p], 6, temperature=0), 1)[0][3 + j % 2]
        kw = dict(num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping)
        ours = beam_search(model, [p], 12, stop=[[eos]], **kw)[0]
        theirs = _hf_generate(hf, p, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos, **kw)
        if ours and ours[-1] == eos:   # transformers pads a finished beam with pad (= eos here)
            theirs = theirs[:len(ours)]
        assert ours == theirs, (j, ours, theirs)
        # without a stop, the best beam runs to max_new_tokens
        if early_stopping is False:
                assert beam_search(model, [p], 7, num_beams)[0] == _hf_generate(hf, p, max_new_tokens=7, do_sample=False,
                                                                             num_beams=num_beams)


def test_beam_search_one_beam_is_greedy(pair):
    model, _ = pair
    prompts = _prompts()
    greedy = _collect(generate(model, prompts, 10, temperature=0), len(prompts))
    assert beam_search(model, prompts, 10, num_beams=1) == greedy


# ---------------------------------------------------------------------------------------------
# batching, stops and the context window

def test_batched_equals_alone(pair):
    model, _ = pair
    prompts = _prompts()
    for kw in (dict(temperature=0), dict(temperature=0, repetition_penalty=1.3)):
        together = _collect(generate(model, prompts, 15, **kw), len(prompts))
        alone = [_collect(generate(model, [p], 15, **kw), 1)[0] for p in prompts]
        assert together == alone
    beams = beam_search(model, prompts, 8, num_beams=3, stop=[[5]])
    assert beams == [beam_search(model, [p], 8, num_beams=3, stop=[[5]])[0] for p in prompts]


def test_multi_token_stop_sequence_stops_one_prompt(pair):
    model, _ = pair
    prompts = _prompts()[:2]
    free = _collect(generate(model, prompts, 12, temperature=0), 2)
    stop = free[0][3:5]           # two ids prompt 0 produces at steps 3-4
    # the first occurrence of `stop` in prompt 0's output ends it (inclusive)
    end = next(i + 2 for i in range(len(free[0]) - 1) if free[0][i:i + 2] == stop)
    gen = generate(model, prompts, 12, temperature=0, stop=[stop])
    steps = list(gen)
    got0 = [s[0] for s in steps]
    assert [t for t in got0 if t is not None] == free[0][:end]
    assert all(t is None for t in got0[end:])
    assert gen.stop_reasons[0] == StopReason.STOP
    assert not any(free[1][i:i + 2] == stop for i in range(11))     # prompt 1 never meets it: it runs on
    assert [s[1] for s in steps] == free[1] and gen.stop_reasons[1] == StopReason.MAX_NEW_TOKENS
    assert gen.tokens[0] == free[0][:end]


def test_context_window(pair):
    model, _ = pair
    B = model.config.block_size
    with pytest.raises(ValueError, match=f"{B + 1} tokens.*block_size={B}"):
        generate(model, [[1] * (B + 1)], 5)
    with pytest.raises(ValueError, match="block_size"):
        beam_search(model, [[1] * (B + 1)], 5, num_beams=2)
    # a prompt of B - 2 tokens has room for 3 new ones (the last one is never fed back)
    gen = generate(model, [[1] * (B - 2), [2, 3]], 10, temperature=0)
    out = _collect(gen, 2)
    assert [len(o) for o in out] == [3, 3]
    assert gen.stop_reasons == [StopReason.CONTEXT, StopReason.CONTEXT]
    # the tokens are still right: they equal a recompute at the edge of the window
    full = [1] * (B - 2) + out[0]
    with torch.no_grad():
        logits = model(torch.tensor([full[:B]]))[0]
    assert logits[B - 3:B].argmax(-1).tolist() == out[0]
    gen = generate(model, [[1] * 4], 3, temperature=0)
    assert len(_collect(gen, 1)[0]) == 3 and gen.stop_reasons == [StopReason.MAX_NEW_TOKENS]


def test_bad_arguments_raise(pair):
    model, _ = pair
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[]], 3)
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        generate(model, [[97]], 3)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[1]], 3, top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [[1]], 3, temperature=-1)
    with pytest.raises(ValueError, match="num_beams"):
        beam_search(model, [[1]], 3, num_beams=0)


# ---------------------------------------------------------------------------------------------
# BERT fill-mask against transformers

def test_fill_mask_equals_transformers():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=120, block_size=32, n_layer=2, n_head=2, n_embd=32, n_inner=64, dropout=0.0)
    ours = BertForPreTraining(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    hf_cfg = transformers.BertConfig(**{k: v for k, v in bert_config_to_hf(cfg, heads=True).items()
                                        if k not in ("model_type", "architectures")})
    hf = transformers.BertForPreTraining(hf_cfg).eval()
    hf.load_state_dict(bert_to_hf(ours.state_dict()), strict=False)
    MASK = 4
    ids = [2, 17, MASK, 33, 51, MASK, 9, 3]
    got = fill_mask(ours, ids, mask_id=MASK, top_k=5)
    with torch.no_grad():
        probs = hf(torch.tensor([ids])).prediction_logits[0].softmax(-1)
    assert len(got) == 2
    for pos, fillers in zip((2, 5), got):
        p, i = probs[pos].topk(5)
        assert [t for t, _ in fillers] == i.tolist()
        assert [q for _, q in fillers] == pytest.approx(p.tolist(), abs=1e-6)
        assert fillers[0][1] >= fillers[-1][1]
    with pytest.raises(ValueError, match="no mask token"):
        fill_mask(ours, [2, 17, 3], mask_id=MASK)


# ---------------------------------------------------------------------------------------------
# text out: UTF-8-safe streaming and stop strings

def test_text_stream_holds_back_split_characters():
    s = TextStream()
    e_acute = "é".encode()                   # b"\xc3\xa9"
    assert s.feed(b"caf" + e_acute[:1]) == "caf"
    assert s.feed(e_acute[1:] + b"!") == "é!"
    assert s.feed("😀".encode()[:2]) == ""
    assert s.feed("😀".encode()[2:]) == "😀"
    assert s.feed(b"\xff") == "\ufffd"      # an invalid byte becomes U+FFFD, never an exception
    assert s.finish() == ""


def test_text_stream_stop_strings():
    s = TextStream(["END", "\n\n"])
    assert s.feed(b"hello E") == "hello "   # "E" might begin "END": held back
    assert s.feed(b"x") == "Ex"               # it did not
    assert s.feed(b" E") == " "
    assert s.feed(b"N") == ""
    assert s.feed(b"D and more") == ""
    assert s.stopped and s.feed(b"later") == "" and s.finish() == ""
    s = TextStream(["\n\n"])
    assert s.feed(b"a\n") == "a"
    assert s.finish() == "\n"                 # at the end nothing is held back


# ---------------------------------------------------------------------------------------------
# the CLI, through cli.main on tiny saved models with trained tokenizers

TEXT = ("The café served crème brûlée. 日本語のテキスト。 Ünïcödé everywhere, naïve façade. " * 3).split(". ")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from duolm.tokenizers import ByteLevelBPE
    d = tmp_path_factory.mktemp("gpt2")
    tok = ByteLevelBPE.train(TEXT, vocab_size=300)
    torch.manual_seed(0)
    cfg = _tiny_config(vocab_size=tok.vocab_size, block_size=32)
    model = GPT2(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    hf_cfg = transformers.GPT2Config(**{k: v for k, v in gpt2_config_to_hf(cfg).items()
                                        if k not in ("model_type", "architectures")})
    hf = transformers.GPT2LMHeadModel(hf_cfg)
    hf.load_state_dict(gpt2_to_hf(model.state_dict()))
    hf.save_pretrained(d)
    tok.save(d)
    return d, model, tok


def _run_cli(capsys, *argv):
    from duolm import cli
    cli.main([str(a) for a in argv])
    return capsys.readouterr()


def test_cli_generate_greedy_matches_library(gpt2_dir, capsys):
    d, model, tok = gpt2_dir
    prompt = "The café"
    ids = tok.encode(prompt)
    new = _collect(generate(model, [ids], 12, temperature=0, stop=[[tok.eot_id]]), 1)[0]
    if new and new[-1] == tok.eot_id:
        new = new[:-1]
    expect = prompt + tok.decode_bytes(new).decode("utf-8", errors="replace") + "\n"
    got = _run_cli(capsys, "generate", d, prompt, "--max-new-tokens", 12, "--temperature", 0).out
    assert got == expect
    # streaming prints the same text; bytes split across tokens never come out broken
    assert _run_cli(capsys, "generate", d, prompt, "--max-new-tokens", 12, "--temperature", 0, "--stream").out == expect
    # the compiled static-shape step prints the same text, and its compile time
    r = _run_cli(capsys, "generate", d, prompt, "--max-new-tokens", 12, "--temperature", 0, "--compile")
    assert r.out == expect and "compiled the decode step in" in r.err


def test_cli_generate_sampling_seed_stop_and_beams(gpt2_dir, capsys):
    d, model, tok = gpt2_dir
    args = ["generate", d, "naïve", "--max-new-tokens", 20, "--temperature", 0.8, "--top-k", 40, "--top-p", 0.95]
    a = _run_cli(capsys, *args, "--seed", 0, "--stream").out
    assert a == _run_cli(capsys, *args, "--seed", 0).out
    assert a != _run_cli(capsys, *args, "--seed", 1).out or a != _run_cli(capsys, *args, "--seed", 2).out
    # --stop cuts the text right before the stop string
    cont = a[len("naïve"):-1]
    stop = cont[3:5]
    cut = _run_cli(capsys, *args, "--seed", 0, "--stop", stop).out
    assert cut == "naïve" + cont[:cont.index(stop)] + "\n"
    beams = _run_cli(capsys, "generate", d, "naïve", "--max-new-tokens", 6, "--num-beams", 3).out
    ids = beam_search(model, [tok.encode("naïve")], 6, 3, stop=[[tok.eot_id]])[0]
    ids = ids[:-1] if ids and ids[-1] == tok.eot_id else ids
    assert beams == "naïve" + tok.decode_bytes(ids).decode("utf-8", errors="replace") + "\n"


def test_cli_generate_context_window(gpt2_dir, capsys):
    d, model, tok = gpt2_dir
    long = "crème brûlée " * 20
    n = len(tok.encode(long))
    assert n > 32
    from duolm import cli
    with pytest.raises(SystemExit):
        cli.main(["generate", str(d), long, "--max-new-tokens", "5"])
    assert f"{n} tokens" in capsys.readouterr().err
    r = _run_cli(capsys, "generate", d, long, "--max-new-tokens", 5, "--temperature", 0, "--truncate", "left")
    assert f"from {n} to 28 tokens" in r.err
    ids = tok.encode(long)[-28:]
    new = _collect(generate(model, [ids], 5, temperature=0, stop=[[tok.eot_id]]), 1)[0]
    new = [t for t in new if t != tok.eot_id]
    assert r.out == long + tok.decode_bytes(new).decode("utf-8", errors="replace") + "\n"
    # a prompt that fits but leaves no room: generation stops at the window with a clear reason
    r = _run_cli(capsys, "generate", d, tok.decode(tok.encode(long)[:31]), "--max-new-tokens", 10, "--temperature", 0)
    assert "context window of 32 tokens is full" in r.err


def test_cli_fill_mask(tmp_path, capsys):
    from duolm.tokenizers import WordPiece
    texts = ["the capital of france is paris.", "the capital of italy is rome.", "paris is in france."] * 5
    tok = WordPiece.train(texts, vocab_size=80)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32, n_inner=64, dropout=0.0)
    ours = BertForPreTraining(cfg).eval()
    hf_cfg = transformers.BertConfig(**{k: v for k, v in bert_config_to_hf(cfg, heads=True).items()
                                        if k not in ("model_type", "architectures")})
    hf = transformers.BertForPreTraining(hf_cfg)
    hf.load_state_dict(bert_to_hf(ours.state_dict()), strict=False)
    hf.save_pretrained(tmp_path)
    tok.save(tmp_path)
    text = "The capital of [MASK] is [MASK]."
    out = _run_cli(capsys, "fill-mask", tmp_path, text, "--top-k", 3).out.splitlines()
    expect = fill_mask(ours, tok.encode(text), tok.mask_id, top_k=3)
    piece = {i: s for s, i in tok.vocab.items()}
    assert out[0] == "[MASK] 1:" and out[4] == "[MASK] 2:" and len(out) == 9
    for lines, fillers in ((out[1:4], expect[0]), (out[5:8], expect[1])):
        assert [ln.split() for ln in lines] == [[piece[i], f"{p:.4f}"] for i, p in fillers]
    with pytest.raises(SystemExit):
        cli_main = __import__("duolm.cli", fromlist=["main"]).main
        cli_main(["fill-mask", str(tmp_path), "no mask here"])
    assert "[MASK]" in capsys.readouterr().err


def test_decoding_a_model_never_quantized_builds_and_probes_nothing(monkeypatch):
    """generate() on a GPT-2 as it was made runs torch alone: duolm.kernels is never built, loaded or asked about the
    CPU, and no engine is timed (each raises here); the model holds no kernel's module (print(model) says so)."""
    from duolm import engines, kernels
    from duolm.models import GPT2, GPT2Config

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel or engine probed while decoding a plain model")
    for module, name in ((kernels, "available"), (kernels, "ready"), (kernels, "cpuinfo"), (engines, "fp32_choice"),
                         (engines, "int8_choice")):
        monkeypatch.setattr(module, name, refuse)
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=97, block_size=48, n_layer=2, n_head=2, n_embd=32)).eval()
    gen = generate(model, [[1, 2, 3], [4]], 10, temperature=0)
    assert len(list(gen)) == 10 and "Kernel" not in repr(model)
