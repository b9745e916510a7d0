"""Structured output (duolm.generation.grammar, llguidance): generate() and generate_text() under a choice, a regex and a
JSON schema, and `duolm serve`'s /v1/completions under OpenAI's response_format and vLLM's guided_* and
structured_outputs fields, checked with the official `openai` client against a real server process: sampled
completions (temperature 1, a tiny random model) are valid texts of their grammar (Python's `re`, `json` and a JSON
schema check written here, not the engine's) and end "stop" within their budget; rows with and without constraints
decode in one batch; an all-permissive grammar draws the very ids of no grammar; the mask (llguidance's bitmask written
in place; duolm.kernels.masked_logits, or the penalty added) equals the plain one (llguidance's bitmask as bytes,
unpacked by numpy)."""
import doctest
import json
import re

import numpy as np
import pytest
import torch

import duolm
from duolm import kernels
from duolm.generation import generate
from duolm.generation.grammar import Grammar, Vocabulary, constrain
from duolm.models import GPT2, GPT2Config
from duolm.textgen import generate_text
from duolm.tokenizers import ByteLevelBPE

pytest.importorskip("llguidance")
pytest.importorskip("fastapi")
from test_serve import gpt2, gpt2_dir, tiny_gpt2  # noqa: E402,F401

# bounded: every string short, every number in a range, no free properties; compact JSON ends within ~40 tokens
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "kind": {"enum": ["cat", "dog", "fish"]},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "kind", "ok"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{1,6}-[0-9]{2,3}"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
BUDGET = 64


def valid_json(text: str) -> bool:
    """SCHEMA checked by hand, and compact: the text is json.dumps' compact form of what it holds."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(d, dict) and list(d) == ["name", "age", "kind", "ok"] and isinstance(d["name"], str)
            and len(d["name"]) <= 6 and type(d["age"]) is int and 0 <= d["age"] <= 120
            and d["kind"] in ("cat", "dog", "fish") and type(d["ok"]) is bool
            and text == json.dumps(d, separators=(",", ":"), ensure_ascii=False)
            or text == json.dumps(d, separators=(",", ":")))


def ascii_tokenizer() -> ByteLevelBPE:
    """128 one-byte tokens, each a whole character, and <|endoftext|> (128): every token continues any text."""
    return ByteLevelBPE({bytes([i]): i for i in range(128)}, {"<|endoftext|>": 128})


def plain_mask(constraint, logits: torch.Tensor) -> torch.Tensor:
    """The reference: llguidance's bitmask as bytes, unpacked by numpy into a bool a token (ids past it never
    allowed), the disallowed logits of the row (V,) set to -inf."""
    bits = np.unpackbits(np.frombuffer(constraint.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
    n = min(len(allowed), len(bits))
    allowed[:n] = torch.from_numpy(bits[:n].view(np.bool_))
    return logits.masked_fill(~allowed, float("-inf"))


@pytest.mark.parametrize("V", [50257, 50304])      # GPT-2's vocabulary; its logits padded to VOCAB_ALIGN (64)
@pytest.mark.parametrize("kernel", [True, False])
def test_the_mask_equals_the_plain_one(data_dir, V, kernel, monkeypatch):
    """A batch of a choice, no constraint, a regex, a JSON schema and no constraint, drawn step by step (sampled
    among the allowed ids) until every grammar is complete: each step's constrain() equals plain_mask row by row, in
    fp32 (duolm.kernels.masked_logits where they run, else the penalty added) and bf16 (the penalty), on logits that
    are a view (as GPT2.head returns them); unconstrained rows come back bit for bit, the logits given are not changed,
    ids past the tokenizer's are -inf, each sequence's bitmask is one buffer."""
    if kernel and not kernels.ready():
        pytest.skip("duolm.kernels do not run on this CPU (AVX2 or AVX-512): the penalty is added (kernel=False)")
    calls, masked_logits = [], kernels.masked_logits
    monkeypatch.setattr(kernels, "masked_logits", lambda *a: calls.append(1) or masked_logits(*a))
    tok = duolm.ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")
    vocab = Vocabulary.of(tok, V)
    assert vocab.kernel == kernels.ready()
    monkeypatch.setattr(vocab, "kernel", kernel)
    constraints = [vocab.constraint(Grammar("choice", CHOICES)), None, vocab.constraint(Grammar("regex", REGEX)),
                   vocab.constraint(Grammar("json", SCHEMA)), None]
    buffers = [c and c.bitmask() for c in constraints]
    g = torch.Generator().manual_seed(0)
    texts, counts = {j: [] for j, c in enumerate(constraints) if c is not None}, set()
    for step in range(BUDGET):
        if all(c is None for c in constraints):
            break
        logits = (torch.randn(len(constraints), V + 7, generator=g) * 4)[:, :V]
        logits[:, 50257 - 3:] = 1e4             # the last ids (<|endoftext|> among them) and the padding most likely
        given = logits.clone()
        for dtype in (torch.bfloat16, torch.float32):
            out = constrain(logits.to(dtype), constraints)
            for j, c in enumerate(constraints):
                want = logits[j].to(dtype) if c is None else plain_mask(c, logits[j].to(dtype))
                assert out.dtype == dtype and torch.equal(out[j], want), (step, j)
        assert torch.equal(logits, given)
        for j, c in enumerate(constraints):
            if c is None:
                continue
            assert c.bitmask() is buffers[j] and torch.equal(c.mask(logits[j:j + 1])[0], out[j])
            assert (out[j, tok.vocab_size:] == float("-inf")).all()
            allowed = torch.isfinite(out[j]).nonzero()[:, 0]
            counts.add(len(allowed))
            t = int(allowed[torch.randint(len(allowed), (1,), generator=g)])
            texts[j] += [] if t == tok.eot_id else [t]
            if t == tok.eot_id or c.advance(t):
                constraints[j] = None
    assert all(c is None for c in constraints) and max(counts) > 1000 and min(counts) < 100       # dense and sparse
    assert len(calls) > step if kernel else not calls       # fp32's constrain() a step, and each c.mask(): the kernel
    assert tok.decode(texts[0]) in CHOICES and re.fullmatch(REGEX, tok.decode(texts[2]))
    assert valid_json(tok.decode(texts[3]))


def test_a_texts_mask_is_computed_once(data_dir):
    """llguidance walks its trie once for each text, as soon as it is known (advance(), the Constraint's creation),
    however many times the draw reads the mask (bitmask(), penalty(), mask()): llguidance's mask of that text."""
    from duolm.generation import grammar

    assert doctest.testmod(grammar).failed == 0                     # penalty_rows' worked example
    tok = duolm.ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")
    c = Vocabulary.of(tok, 50257).constraint(Grammar("choice", CHOICES))

    class Counted:                                                  # the matcher, its walks into a buffer counted
        walks = 0

        def __init__(self, matcher):
            self.matcher = matcher

        def unsafe_compute_mask_ptr(self, *args):
            Counted.walks += 1
            return self.matcher.unsafe_compute_mask_ptr(*args)

        def __getattr__(self, name):
            return getattr(self.matcher, name)

    c.matcher = Counted(c.matcher)
    logits = torch.zeros(1, 50257)
    before = None
    for walks, t in enumerate([None, *tok.encode("mixed feelings")]):
        if t is not None:
            c.advance(t)
        bits, bias, masked = c.bitmask().clone(), c.penalty(), c.mask(logits)
        assert Counted.walks == walks and torch.equal(c.bitmask(), bits)
        engine = np.frombuffer(c.matcher.compute_bitmask(), dtype=np.uint8)
        assert np.array_equal(bits.numpy().view(np.uint8)[0, :len(engine)], engine)
        assert torch.equal(masked, plain_mask(c, logits[0])[None]) and torch.equal(masked, logits + bias)
        assert before is None or not torch.equal(bits, before)
        before = bits


def test_server_draws_equal_each_row_drawn_alone(data_dir):
    """serve.draws.next_tokens masks a step's constrained rows in one call, before their penalties and logit_bias: each
    row's token equals the row drawn alone with its penalties, bias, mask (after them) and settings, greedy and
    sampled; a bias on a token the grammar forbids leaves it forbidden."""
    from duolm.generation import next_token
    from duolm.serve.draws import next_tokens, penalized
    from duolm.serve.rows import Row

    tok = duolm.ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")
    vocab = Vocabulary.of(tok, 50257)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(4, 50257, generator=g) * 3
        settings = [dict(constraint=vocab.constraint(Grammar("choice", CHOICES)), presence_penalty=0.5,
                         frequency_penalty=1.0, logit_bias={tok.encode("neg")[0]: 5.0}, temperature=0.0),
                    dict(temperature=0.0),
                    dict(constraint=vocab.constraint(Grammar("regex", REGEX)), temperature=0.8, top_k=50),
                    dict(constraint=vocab.constraint(Grammar("json", SCHEMA)), temperature=0.0,
                         logit_bias={tok.encode("[")[0]: 100.0})]
        rows = [Row(prompt=[1], max_tokens=4, tokens=[5, 5, 9], **k) for k in settings]
        for r in rows:
            r.generator = torch.Generator().manual_seed(seed)
        got = next_tokens(rows, logits)
        for j, r in enumerate(rows):
            alone = penalized(logits[j:j + 1], r.tokens, r.presence_penalty, r.frequency_penalty, r.logit_bias)
            alone = alone if r.constraint is None else plain_mask(r.constraint, alone[0])[None]
            want = next_token(alone, r.temperature, r.top_k, r.top_p, torch.Generator().manual_seed(seed))[0]
            assert got[j] == int(want), (seed, j)
        assert tok.decode([got[3]]).startswith("{") and any(c.startswith(tok.decode([got[0]])) for c in CHOICES)


def test_generate_text_follows_each_grammar(gpt2):
    model, tok = gpt2
    for seed in range(8):
        for grammar, ok in ((Grammar("choice", CHOICES), lambda t: t in CHOICES),
                            (Grammar("regex", REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
                            (Grammar("json", SCHEMA), valid_json)):
            gen = generate_text(model, tok, "The answer:", BUDGET, seed=seed, grammar=grammar)
            text = "".join(gen)
            assert ok(text) and gen.stop_reason == "stop", (grammar.kind, text)
    with pytest.raises(ValueError, match="unclosed group"):
        Vocabulary.of(tok, model.config.vocab_size).constraint(Grammar("regex", "a(b"))
    with pytest.raises(ValueError, match="beam search"):
        generate_text(model, tok, "x", 5, num_beams=2, grammar=Grammar("regex", "a+"))


def test_a_permissive_grammar_draws_the_ids_of_none():
    """Over a vocabulary of whole characters, (?s:.*) allows every token at every step (end of text included): the
    masked draws are those of no grammar, seed for seed; a grammar that allows less draws other ids."""
    tok = ascii_tokenizer()
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=129, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()   # near uniform
    vocab = Vocabulary.of(tok, 129)
    for seed in range(4):
        runs = []
        for constraint in (None, vocab.constraint(Grammar("regex", r"(?s:.*)")), vocab.constraint(Grammar("regex", "[a-z ]*"))):
            gen = generate(model, [[1, 2, 3]], 30, stop=[[128]], generator=torch.Generator().manual_seed(seed),
                           constraints=[constraint])
            for _ in gen:
                pass
            runs.append(gen.tokens[0])
        assert runs[1] == runs[0] and len(runs[0]) == 30
        assert runs[2] != runs[0] and all(t in range(97, 123) or t in (32, 128) for t in runs[2])


def test_rows_with_and_without_grammars_in_one_generate(gpt2):
    model, tok = gpt2
    vocab = Vocabulary.of(tok, model.config.vocab_size)
    prompts = [tok.encode(p) for p in ("Pick one:", "Free text", "Code:")]
    constraints = [vocab.constraint(Grammar("choice", CHOICES)), None, vocab.constraint(Grammar("regex", REGEX))]
    gen = generate(model, prompts, 20, generator=torch.Generator().manual_seed(3), constraints=constraints)
    for _ in gen:
        pass
    free = generate(model, prompts[1:2], 20, generator=torch.Generator().manual_seed(3))
    assert tok.decode(gen.tokens[0]) in CHOICES and re.fullmatch(REGEX, tok.decode(gen.tokens[2]))
    assert gen.stop_reasons[0] == gen.stop_reasons[2] == "stop" and gen.stop_reasons[1] == "max_new_tokens"
    assert len(gen.tokens[1]) == 20 and next(free) is not None
    with pytest.raises(ValueError, match="one per prompt"):
        generate(model, prompts, 5, constraints=[None])


@pytest.fixture(scope="module")
def served(gpt2_dir, tmp_path_factory):
    from test_serve_e2e import server
    with server(gpt2_dir, tmp_path_factory.mktemp("log") / "serve.log", "--max-concurrency", "128") as (url, _):
        yield url


def _client(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


N = 1000         # completions per constraint: 8 requests of n=125 (a request's n is at most 128)


@pytest.mark.parametrize("field,value,ok", [
    ("guided_choice", CHOICES, lambda t: t in CHOICES),
    ("guided_regex", REGEX, lambda t: re.fullmatch(REGEX, t) is not None),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}, valid_json),
])
def test_openai_client_sampled_completions_are_all_valid(served, field, value, ok):
    client = _client(served)
    choices, tokens = [], 0
    for seed in range(8):
        r = client.completions.create(model="tiny-gpt2", prompt="Answer:", max_tokens=BUDGET, temperature=1.0,
                                      n=N // 8, seed=seed, extra_body={field: value})
        choices += r.choices
        tokens += r.usage.completion_tokens
    assert len(choices) == N
    bad = [(c.text, c.finish_reason) for c in choices if not (ok(c.text) and c.finish_reason == "stop")]
    assert bad == []
    assert tokens <= N * BUDGET and len({c.text for c in choices}) > 1


def test_openai_client_json_object_stream_and_unconstrained_rows_beside(served):
    """json_object, streamed, beside unconstrained requests in the same batches: each stopped completion is a JSON
    object; the unconstrained ones are those of a request alone."""
    import concurrent.futures
    client = _client(served)
    plain = dict(model="tiny-gpt2", prompt="Once", max_tokens=12, temperature=1.0, seed=3)
    alone = client.completions.create(**plain).choices[0].text

    def streamed(seed):
        texts, reasons = {}, {}
        for chunk in client.completions.create(model="tiny-gpt2", prompt="{", max_tokens=BUDGET, temperature=1.0,
                                               n=8, seed=seed, stream=True,
                                               extra_body={"structured_outputs": {"json_object": True}}):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
        return texts, reasons

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(streamed, s) for s in range(4)]
        beside = [pool.submit(lambda: client.completions.create(**plain).choices[0].text) for _ in range(2)]
        results = [j.result() for j in jobs]
    assert [b.result() for b in beside] == [alone, alone]
    stopped = [t for texts, reasons in results for k, t in texts.items() if reasons[k] == "stop"]
    assert all(isinstance(json.loads(t), dict) for t in stopped)
    assert all(t.startswith("{") for texts, _ in results for t in texts.values())


@pytest.mark.parametrize("body,field", [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_json": {"type": "nope"}}, "guided_json"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_bad_or_conflicting_constraints_are_400_naming_the_field(served, body, field):
    import httpx
    r = httpx.post(served + "/v1/completions", json={"prompt": "x", "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert r.json()["error"]["message"].startswith(field)


def test_cli_generate_choice_regex_schema(gpt2_dir, tmp_path, capsys):
    from duolm.cli import main
    main(["generate", str(gpt2_dir), "Q:", "--choice", "yes", "--choice", "no", "--seed", "1"])
    assert capsys.readouterr().out in ("Q:yes\n", "Q:no\n")
    main(["generate", str(gpt2_dir), "", "--regex", REGEX, "--seed", "2"])
    assert re.fullmatch(REGEX, capsys.readouterr().out.strip())
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    main(["generate", str(gpt2_dir), "", "--json-schema", str(tmp_path / "s.json"), "--seed", "3",
          "--max-new-tokens", str(BUDGET)])
    assert valid_json(capsys.readouterr().out.strip())
    with pytest.raises(SystemExit):
        main(["generate", str(gpt2_dir), "", "--regex", "a(b"])
    err = capsys.readouterr().err
    assert "unclosed group" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert duolm  # the package's lazy API stays importable beside the grammar extra
