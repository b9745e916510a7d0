"""duolm.data: token shards, prepare, causal windows, BERT pairs and masking."""
import json
import math
import random

import numpy as np
import pytest
import torch

from duolm.data import (
    IGNORE,
    BertBatches,
    CausalBatches,
    Instance,
    MaskSpec,
    collate,
    create_instances_from_document,
    load_documents,
    load_meta,
    mask_tokens,
    open_split,
    pack_full_sentences,
    prepare,
    read_shard,
    truncate_seq_pair,
    write_shard,
)
from duolm.data.shards import HEADER


# --- stand-in tokenizers (the real ones are tested at the end against reference libraries) ------

class ByteTok:
    """A byte-level 'BPE' with no merges: ids are the UTF-8 bytes, 256 is <|endoftext|>."""
    kind = "bpe"
    vocab_size = 257
    special_tokens = {"<|endoftext|>": 256}

    def encode_ordinary(self, text):
        return list(text.encode("utf-8"))

    def save(self, directory):          # a fake has no files to write
        pass

    @staticmethod
    def safe_chunks(text, chunk_chars):
        from duolm.tokenizers.pieces import safe_chunks
        return safe_chunks(text, chunk_chars)


class WordTok:
    """A whitespace 'WordPiece': a word in the vocab is one id, any other word is [UNK]."""
    kind = "wordpiece"

    def __init__(self, words):
        self.vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(words)))}
        self.vocab_size = len(self.vocab)
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = range(5)

    def save(self, directory):          # a fake has no files to write
        pass

    def tokenize(self, text):
        return [w if w in self.vocab else "[UNK]" for w in text.lower().split()]


SPEC = MaskSpec(vocab_size=1000, pad_id=0, cls_id=2, sep_id=3, mask_id=4, special_ids=frozenset({1}))
CLS, SEP, MASK = 2, 3, 4


class ScriptedRng:
    """A random.Random stand-in that plays back fixed draws (shuffle keeps the order)."""

    def __init__(self, randoms=(), ints=()):
        self.randoms, self.ints = list(randoms), list(ints)

    def random(self):
        return self.randoms.pop(0)

    def randrange(self, n):
        return self.ints.pop(0)

    def randint(self, a, b):
        return self.ints.pop(0)

    def shuffle(self, x):
        pass


# --- shards -----------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab_size,dtype", [(50257, np.uint16), (65536, np.uint16), (65537, np.uint32), (200_000, np.uint32)])
def test_shard_round_trip(tmp_path, vocab_size, dtype):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab_size, size=10_001)
    tokens[:2] = [0, vocab_size - 1]
    path = write_shard(tmp_path / "s.bin", tokens, vocab_size)
    back = read_shard(path)
    assert back.dtype == dtype and isinstance(back, np.memmap)
    np.testing.assert_array_equal(back, tokens)
    assert path.stat().st_size == HEADER.size + tokens.size * np.dtype(dtype).itemsize
    assert not (tmp_path / "s.bin.tmp").exists()
    assert len(read_shard(write_shard(tmp_path / "e.bin", [], 10))) == 0


def test_shard_rejects_ids_outside_vocab(tmp_path):
    with pytest.raises(ValueError, match=r"\[0, 100\).*max 100"):
        write_shard(tmp_path / "s.bin", [1, 100], vocab_size=100)
    with pytest.raises(ValueError, match="min -1"):
        write_shard(tmp_path / "s.bin", [-1, 5])


def test_corrupt_shards_name_the_file(tmp_path):
    good = write_shard(tmp_path / "good.bin", np.arange(100), 1000).read_bytes()
    cases = {
        "short.bin": good[:10],                          # shorter than the header
        "magic.bin": b"NOTMAGIC" + good[8:],
        "version.bin": good[:8] + (7).to_bytes(4, "little") + good[12:],
        "dtype.bin": good[:12] + (3).to_bytes(4, "little") + good[16:],
        "truncated.bin": good[:-2],
        "longer.bin": good + b"\0\0",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=name):
            read_shard(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        read_shard(tmp_path / "missing.bin")


# --- prepare ----------------------------------------------------------------------------------

def _corpus(tmp_path, n_files=3, paragraphs=60):
    rng = random.Random(0)
    words = "the cat sat on a mat while dogs ran past quickly , and birds sang über café".split()
    files = []
    for f in range(n_files):
        docs = []
        for _ in range(paragraphs):
            lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) for _ in range(rng.randint(1, 6))]
            docs.append("\n".join(lines))
        p = tmp_path / f"f{f}.txt"
        p.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
        files.append(p)
    return files, words


def _dir_bytes(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_prepare_bpe_stream_and_workers_identical(tmp_path):
    files, _ = _corpus(tmp_path)
    kw = dict(val_fraction=0.1, chunk_chars=500, shard_size=3000)
    m1 = prepare(files, ByteTok(), tmp_path / "w1", workers=1, **kw)
    m2 = prepare(files, ByteTok(), tmp_path / "w2", workers=2, **kw)
    assert m1 == m2 and _dir_bytes(tmp_path / "w1") == _dir_bytes(tmp_path / "w2")
    assert load_meta(tmp_path / "w1") == m1
    train, val = m1["splits"]["train"], m1["splits"]["val"]
    assert len(train["shards"]) > 1 and train["tokens"] > 0 and val["tokens"] > 0
    text = b"".join(f.read_bytes() for f in files)
    # every byte lands in exactly one split; val is about 10% of the text, whole chunks
    assert train["tokens"] + val["tokens"] == len(text) + train["documents"] + val["documents"]
    assert 0.05 < val["tokens"] / (train["tokens"] + val["tokens"]) < 0.15
    shards = open_split(tmp_path / "w1", "train")
    assert all(s.dtype == np.uint16 for s in shards)
    assert [len(s) for s in shards[:-1]] == [3000] * (len(shards) - 1)  # full shards, the rest in the last
    stream = np.concatenate(shards + open_split(tmp_path / "w1", "val"))
    assert (stream == 256).sum() >= len(files)  # one end-of-text per file (more where val cuts a document)
    # with no val split the stream is exactly the files, each followed by <|endoftext|>
    prepare(files, ByteTok(), tmp_path / "w0", workers=2, val_fraction=0, chunk_chars=500)
    stream = np.concatenate(open_split(tmp_path / "w0", "train"))
    want = np.concatenate([np.append(np.frombuffer(f.read_bytes(), np.uint8), 256) for f in files])
    np.testing.assert_array_equal(stream, want)
    assert load_meta(tmp_path / "w0")["splits"]["val"]["tokens"] == 0
    assert open_split(tmp_path / "w0", "val") == []
    # preparing again into a used directory leaves no shard of the earlier run behind
    prepare(files[:1], ByteTok(), tmp_path / "w1", val_fraction=0)
    assert sorted(p.name for p in (tmp_path / "w1").iterdir()) == ["meta.json", "train_000000.bin", "val_000000.bin"]


def test_prepare_wordpiece_documents(tmp_path):
    files, words = _corpus(tmp_path, n_files=2)
    tok = WordTok(words)
    kw = dict(val_fraction=0.2, chunk_chars=1000, shard_size=500)
    m1 = prepare(files, tok, tmp_path / "w1", workers=1, **kw)
    m2 = prepare(files, tok, tmp_path / "w2", workers=2, **kw)
    assert m1 == m2 and _dir_bytes(tmp_path / "w1") == _dir_bytes(tmp_path / "w2")
    assert m1["kind"] == "wordpiece" and m1["mask_id"] == 4
    docs = load_documents(tmp_path / "w1", "train") + load_documents(tmp_path / "w1", "val")
    # the documents are the blank-line separated paragraphs (none here is longer than a chunk)
    want = []
    for f in files:
        for para in f.read_text().split("\n\n"):
            sents = [[tok.vocab[w] for w in line.split()] for line in para.split("\n") if line.strip()]
            if sents:
                want.append(sents)
    key = lambda d: json.dumps(d)  # noqa: E731
    assert sorted(map(key, docs)) == sorted(map(key, want))
    n_val = m1["splits"]["val"]["documents"]
    assert 0.1 < n_val / len(want) < 0.3 and m1["splits"]["train"]["sentences"] > 0
    assert len(m1["splits"]["train"]["shards"]) > 1
    # a document longer than a chunk is cut at line ends into documents of whole sentences
    long = tmp_path / "long.txt"
    long.write_text("\n".join(" ".join(words[i % 10:i % 10 + 5]) for i in range(300)) + "\n\nthe cat\n")
    prepare([long], tok, tmp_path / "w3", val_fraction=0, chunk_chars=1000)
    docs = load_documents(tmp_path / "w3", "train")
    assert len(docs) > 3 and docs[-1] == [[tok.vocab["the"], tok.vocab["cat"]]]
    assert [s for d in docs[:-1] for s in d] == [[tok.vocab[w] for w in words[i % 10:i % 10 + 5]] for i in range(300)]
    assert all(sum(len(s) for s in d) < 1000 / 2 for d in docs)


def test_prepare_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prepare([tmp_path / "nope.txt"], ByteTok(), tmp_path / "o")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe abc")
    with pytest.raises(ValueError, match="bad.txt.*UTF-8"):
        prepare([tmp_path / "bad.txt"], ByteTok(), tmp_path / "o")
    (tmp_path / "small.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="too small for a validation split"):
        prepare([tmp_path / "small.txt"], ByteTok(), tmp_path / "o", val_fraction=0.1)
    with pytest.raises(FileNotFoundError, match="meta.json"):
        open_split(tmp_path / "o", "train")


# --- causal windows ---------------------------------------------------------------------------

def test_causal_sequential_covers_all_windows_and_ranks_are_disjoint():
    shards = [np.arange(0, 1000), np.arange(10_000, 10_517)]  # windows must not cross the boundary
    T, B = 16, 8
    data = CausalBatches(shards, T, order="sequential")
    assert data.num_windows == 999 // 16 + 516 // 16
    seen = []
    steps = math.ceil(data.num_windows / B)
    for step in range(steps):
        full = data.batch(step, B)
        parts = [data.batch(step, B, rank=r, world_size=4) for r in range(4)]
        assert torch.equal(torch.cat([p["x"] for p in parts]), full["x"])
        assert torch.equal(full["y"], full["x"] + 1)  # y is x shifted by one (consecutive ids here)
        seen += full["x"][:, 0].tolist()
    first = seen[:data.num_windows]
    assert first == list(range(0, 999 - 15, 16))[:999 // 16] + list(range(10_000, 10_000 + 516 - 15, 16))[:516 // 16]
    assert seen[data.num_windows:] == first[:len(seen) - data.num_windows]  # wraps around
    # eval: every window exactly once across ranks
    ev = [b["x"][:, 0].tolist() for r in range(3) for b in data.eval_batches(10, rank=r, world_size=3)]
    assert sorted(sum(ev, [])) == sorted(first)
    with pytest.raises(ValueError, match="multiple of world_size 3"):
        data.batch(0, 8, rank=0, world_size=3)


def test_causal_random_and_shuffle_are_deterministic_in_seed_and_step():
    shards = [np.arange(0, 5000), np.arange(100_000, 103_000)]
    T = 32
    r1 = CausalBatches(shards, T, seed=3, order="random")
    r2 = CausalBatches(shards, T, seed=3, order="random")
    for step in (0, 7, 123456):
        assert torch.equal(r1.batch(step, 16)["x"], r2.batch(step, 16)["x"])
    assert not torch.equal(r1.batch(0, 16)["x"], r1.batch(1, 16)["x"])
    assert not torch.equal(r1.batch(0, 16)["x"], CausalBatches(shards, T, seed=4).batch(0, 16)["x"])
    xs = torch.cat([r1.batch(s, 64)["x"] for s in range(50)])
    ys = torch.cat([r1.batch(s, 64)["y"] for s in range(50)])
    assert torch.equal(ys, xs + 1)  # never crosses a shard boundary: ids stay consecutive
    starts = xs[:, 0]
    assert starts.min() >= 0 and ((starts <= 5000 - 33) | ((starts >= 100_000) & (starts <= 103_000 - 33))).all()
    assert ((starts >= 100_000).float().mean() - 3000 / 8000).abs() < 0.05  # shards drawn by size
    # shuffle: each epoch is a permutation of all windows, different between epochs, reproducible
    s = CausalBatches(shards, T, seed=1, order="shuffle")
    W = s.num_windows
    epoch = [s.batch(i, 1)["x"][0, 0].item() for i in range(2 * W)]
    assert sorted(epoch[:W]) == sorted(epoch[W:]) and len(set(epoch[:W])) == W and epoch[:W] != epoch[W:]
    assert epoch[:W] == [CausalBatches(shards, T, seed=1, order="shuffle").batch(i, 1)["x"][0, 0].item()
                         for i in range(W)]


def test_causal_errors():
    with pytest.raises(ValueError, match="block_size \\+ 1 = 101"):
        CausalBatches([np.arange(50)], 100)
    with pytest.raises(ValueError, match="order"):
        CausalBatches([np.arange(50)], 10, order="sorted")


# --- pairs and truncation ---------------------------------------------------------------------

def test_truncate_seq_pair_worked_example():
    a, b = [1, 2, 3, 4, 5], [6, 7]
    truncate_seq_pair(a, b, 4, ScriptedRng(randoms=[0.1, 0.9, 0.3]))  # front, back, front of the longer
    assert (a, b) == ([3, 4], [6, 7])
    a, b = [1, 2], [3, 4]
    truncate_seq_pair(a, b, 3, ScriptedRng(randoms=[0.7]))  # equal lengths: B loses its last token
    assert (a, b) == ([1, 2], [3])
    a, b = [1], [2]
    truncate_seq_pair(a, b, 5, ScriptedRng())  # already short: untouched, no draw
    assert (a, b) == ([1], [2])


def _numbered_docs(n_docs, n_sents, sent_len=1, start=10):
    """Sentence s of document d is sent_len copies of a unique id: pairs can be traced back."""
    return [[[start + d * 100_000 + s] * sent_len for s in range(n_sents)] for d in range(n_docs)]


def test_nsp_pairs_fifty_fifty_true_next_follows_random_from_other_document():
    docs = _numbered_docs(20, 5000)
    rng = random.Random(0)
    insts = [i for d in range(len(docs)) for i in create_instances_from_document(docs, d, 32, 0.1, rng, CLS, SEP)]
    n = len(insts)
    assert n > 4000
    lengths = [len(i.tokens) for i in insts]
    assert max(lengths) <= 32 and min(lengths) >= 5
    assert sum(x < 32 for x in lengths) > 0.05 * n  # short_seq_prob makes some shorter
    n_random = 0
    for inst in insts:
        t, seg = inst.tokens, inst.segment_ids
        sep = t.index(SEP)
        a, b = t[1:sep], t[sep + 1:-1]
        assert t[0] == CLS and t[-1] == SEP and seg == [0] * (sep + 1) + [1] * (len(t) - sep - 1)
        assert all(y == x + 1 for x, y in zip(a, a[1:])) and all(y == x + 1 for x, y in zip(b, b[1:]))
        if inst.is_random_next:
            n_random += 1
            assert a[0] // 100_000 != b[0] // 100_000  # B from another document
        else:
            assert b[0] == a[-1] + 1  # B is the true continuation
    p = n_random / n
    # 50/50 within 5 sigma; single-sentence chunks (at most one per document end) are always random
    assert abs(p - 0.5) < 5 * math.sqrt(0.25 / n) + 20 / n, p


def test_put_back_unused_segments():
    # 4 sentences of 10 tokens, target 27: chunk = 3 sentences; random next keeps only A's sentence
    docs = [[[i] * 10 for i in range(10, 14)], [[i] * 10 for i in range(50, 60)]]
    rng = ScriptedRng(randoms=[0.9,            # no short sequence: target 27
                               0.1,            # coin: random next
                               0.6, 0.6, 0.6,  # truncation (A 10 + B 20 > 27): B loses its last 3
                               0.9,            # second chunk: true next
                               0.6, 0.6, 0.6],
                      ints=[1, 1, 3,  # a_end = 1; random document 1; start at its sentence 3
                            1])       # second chunk: a_end = 1
    insts = create_instances_from_document(docs, 0, 30, 0.1, rng, CLS, SEP)
    assert insts[0].is_random_next and insts[0].tokens == [CLS] + [10] * 10 + [SEP] + [53] * 10 + [54] * 7 + [SEP]
    # sentences 11 and 12 were put back: the next pair starts at sentence 11
    assert insts[1].tokens == [CLS] + [11] * 10 + [SEP] + [12] * 10 + [13] * 7 + [SEP] and not insts[1].is_random_next
    assert len(insts) == 2 and not rng.randoms and not rng.ints


def test_pack_full_sentences():
    docs = [[[5] * 7, [6] * 9], [[7] * 30], [[8] * 4, [9] * 3]]
    insts = pack_full_sentences(docs, 20, CLS, SEP)
    assert [i.tokens for i in insts] == [
        [CLS] + [5] * 7 + [6] * 9 + [SEP],
        [CLS] + [7] * 18 + [SEP],                    # a sentence longer than a sequence is cut
        [CLS] + [7] * 12 + [SEP, 8, 8, 8, 8] + [SEP],  # [SEP] between documents inside a sequence
        [CLS] + [9] * 3 + [SEP],
    ]
    assert all(i.is_random_next is None and i.segment_ids == [0] * len(i.tokens) for i in insts)


# --- masking ----------------------------------------------------------------------------------

def test_mask_tokens_worked_example():
    tokens = [CLS, 10, 11, 12, 13, 14, SEP, 15, 16, 17, SEP]  # 11 tokens * 0.3 -> 3 predictions
    rng = ScriptedRng(randoms=[0.5,        # position 1: [MASK]
                               0.85, 0.3,  # position 2: kept
                               0.9, 0.7],  # position 3: random token
                      ints=[MASK, 1, 42])  # specials ([MASK], [UNK]) are redrawn
    out, pos, labels = mask_tokens(tokens, SPEC, rng, masked_lm_prob=0.3, max_predictions_per_seq=20)
    assert out == [CLS, MASK, 11, 42, 13, 14, SEP, 15, 16, 17, SEP]
    assert pos == [1, 2, 3] and labels == [10, 11, 12]
    # the per-sequence cap
    out, pos, labels = mask_tokens(tokens, SPEC, ScriptedRng(randoms=[0.1, 0.1]), 0.3, max_predictions_per_seq=2)
    assert pos == [1, 2] and out[1:3] == [MASK, MASK]
    # at least one prediction even for a short sequence
    out, pos, labels = mask_tokens([CLS, 10, SEP], SPEC, ScriptedRng(randoms=[0.1]), 0.15)
    assert out == [CLS, MASK, SEP] and pos == [1]


def test_whole_word_masking_worked_example():
    spec = MaskSpec(vocab_size=100, pad_id=0, cls_id=2, sep_id=3, mask_id=4, subword_ids=frozenset({20, 21, 22}))
    tokens = [CLS, 10, 20, 21, 11, 22, 12, SEP]  # words: [10 ##20 ##21] [11 ##22] [12]; budget round(8*0.5) = 4
    out, pos, _ = mask_tokens(tokens, spec, ScriptedRng(randoms=[0.1] * 4), 0.5, 20, whole_word=True)
    assert pos == [1, 2, 3, 6]  # [11 ##22] would overshoot the budget and is skipped
    out, pos, _ = mask_tokens([CLS, SEP, 20, 10], spec, ScriptedRng(randoms=[0.1] * 2), 0.5, 20, whole_word=True)
    assert pos == [2, 3] or pos == [2]  # a "##" piece after a special token starts its own word


def test_masking_statistics():
    rng = random.Random(1234)
    trng = np.random.default_rng(0)
    L, n_seq = 128, 6000
    selected = mask_rep = keep = rand = total = 0
    per_pos = np.zeros(L)
    rand_ids = []
    for _ in range(n_seq):
        body = trng.integers(5, SPEC.vocab_size, size=L).tolist()
        s = int(trng.integers(10, L - 10))
        tokens = [CLS] + body[:s - 1] + [SEP] + body[s:L - 2] + [SEP]
        assert len(tokens) == L
        tokens[int(trng.integers(1, L - 1))] = 1  # an [UNK]: special here, never masked
        out, pos, labels = mask_tokens(tokens, SPEC, rng, masked_lm_prob=0.15, max_predictions_per_seq=L)
        assert len(pos) == round(0.15 * L) and labels == [tokens[p] for p in pos]
        total += L
        for p in pos:
            assert tokens[p] not in SPEC.special_ids
            selected += 1
            per_pos[p] += 1
            if out[p] == MASK:
                mask_rep += 1
            elif out[p] == tokens[p]:
                keep += 1
            else:
                rand += 1
                rand_ids.append(out[p])
        unselected = np.ones(L, bool)
        unselected[pos] = False
        assert all(out[i] == tokens[i] for i in np.flatnonzero(unselected))
    assert total >= 10**5
    assert abs(selected / total - 0.15) < 0.5 / L  # 15% up to rounding per sequence
    sd = lambda p: math.sqrt(p * (1 - p) / selected)  # noqa: E731
    assert abs(mask_rep / selected - 0.8) < 5 * sd(0.8)
    assert abs(keep / selected - 0.1) < 5 * sd(0.1) + 1 / SPEC.vocab_size  # (a random draw can hit the original)
    assert abs(rand / selected - 0.1) < 5 * sd(0.1)
    assert not set(rand_ids) & SPEC.special_ids and len(set(rand_ids)) > 0.9 * (SPEC.vocab_size - 5)
    # every ordinary position is chosen about equally often (positions 0 and the last are always [CLS]/[SEP])
    assert per_pos[0] == per_pos[-1] == 0
    inner = per_pos[2:-2] / n_seq
    assert np.abs(inner - 0.15 * L / (L - 3.5)).max() < 0.03


def test_whole_word_masking_masks_whole_words():
    subs = frozenset(range(500, 1000))  # ids >= 500 are "##" pieces
    spec = MaskSpec(vocab_size=1000, pad_id=0, cls_id=2, sep_id=3, mask_id=4, subword_ids=subs)
    rng, trng = random.Random(0), np.random.default_rng(1)
    n_words_hit = 0
    for _ in range(500):
        ids = trng.integers(5, 1000, size=100).tolist()
        tokens = [CLS] + ids + [SEP]
        out, pos, _ = mask_tokens(tokens, spec, rng, 0.15, 40, whole_word=True)
        chosen = set(pos)
        assert len(chosen) <= round(0.15 * len(tokens))
        words, cur = [], []
        for i, t in enumerate(tokens[1:-1], start=1):
            if t in subs and cur:
                cur.append(i)
            else:
                cur = [i]
                words.append(cur)
        for w in words:
            hit = [i in chosen for i in w]
            assert all(hit) or not any(hit), (w, pos)
            n_words_hit += all(hit) and len(w) > 1
    assert n_words_hit > 500  # multi-piece words were masked, whole


def _toy_docs(n_docs=30, seed=0):
    r = random.Random(seed)
    return [[[r.randrange(5, 1000) for _ in range(r.randint(3, 20))] for _ in range(r.randint(5, 40))]
            for _ in range(n_docs)]


def _by_index(data, epoch, B):
    out = {}
    steps = data.num_examples // B
    for step in range(epoch * steps, (epoch + 1) * steps):
        batch = data.batch(step, B)
        for row, i in enumerate(data.indices(step, B)):
            n = int(batch["attention_mask"][row].sum())
            out[i] = (batch["idx"][row, :n].tolist(), batch["mlm_labels"][row, :n].tolist())
    return out


def test_static_masks_repeat_across_epochs_dynamic_masks_differ():
    docs = _toy_docs()
    static = BertBatches(docs, SPEC, max_seq_length=64, seed=0, masking="static", dupe_factor=1)
    B = 8
    static.instances = static.instances[:static.num_examples // B * B]  # whole epochs
    e0, e1 = _by_index(static, 0, B), _by_index(static, 1, B)
    assert e0 == e1 and len(e0) == static.num_examples
    assert static.indices(0, B) != static.indices(static.num_examples // B, B)  # but a new order

    dyn = BertBatches(docs, SPEC, max_seq_length=64, seed=0, masking="dynamic")
    dyn.instances = dyn.instances[:dyn.num_examples // B * B]
    d0, d1 = _by_index(dyn, 0, B), _by_index(dyn, 1, B)
    assert d0.keys() == d1.keys()
    differ = sum(d0[i] != d1[i] for i in d0)
    assert differ > 0.95 * len(d0)
    # unmasked content is the same instance: labels fill back to the same tokens
    fill = lambda ids, lab: [l if l != IGNORE else t for t, l in zip(ids, lab)]  # noqa: E731
    assert all(fill(*d0[i]) == fill(*d1[i]) for i in d0)
    # a batch is a pure function of (seed, step)
    again = BertBatches(docs, SPEC, max_seq_length=64, seed=0, masking="dynamic")
    for k in ("idx", "mlm_labels", "nsp_labels"):
        assert torch.equal(again.batch(5, B)[k], BertBatches(docs, SPEC, max_seq_length=64, seed=0,
                                                             masking="dynamic").batch(5, B)[k])

    # dupe_factor: copies of the corpus with different masks
    duped = BertBatches(docs, SPEC, max_seq_length=64, seed=0, masking="static", dupe_factor=3)
    assert 2.5 * static.num_examples < duped.num_examples < 3.5 * static.num_examples


def test_bert_batch_tensors_and_ranks():
    docs = _toy_docs()
    data = BertBatches(docs, SPEC, max_seq_length=48, seed=1, masking="dynamic", pad_to=48)
    full = data.batch(3, 8)
    assert set(full) == {"idx", "segment_ids", "attention_mask", "mlm_labels", "nsp_labels"}
    assert full["idx"].shape == (8, 48) and full["idx"].dtype == torch.long and full["nsp_labels"].shape == (8,)
    pad = full["attention_mask"] == 0
    assert (full["idx"][pad] == SPEC.pad_id).all() and (full["mlm_labels"][pad] == IGNORE).all()
    assert ((full["mlm_labels"] != IGNORE).sum(1) >= 1).all()
    parts = [data.batch(3, 8, rank=r, world_size=2) for r in range(2)]
    for k in full:  # two ranks together see exactly the one-process batch, masks included
        assert torch.equal(torch.cat([p[k] for p in parts]), full[k])
    nonsp = BertBatches(docs, SPEC, max_seq_length=48, nsp=False).batch(0, 4)
    assert "nsp_labels" not in nonsp and (nonsp["segment_ids"] == 0).all()
    ev = list(data.eval_batches(16, rank=1, world_size=2))
    assert sum(len(b["idx"]) for b in ev) == data.num_examples // 2
    assert torch.equal(ev[0]["idx"], next(data.eval_batches(16, rank=1, world_size=2))["idx"])  # fixed masks


def test_collate_worked_example():
    ex = [{"idx": [2, 4, 3], "segment_ids": [0, 0, 0], "mlm_labels": [IGNORE, 7, IGNORE], "nsp_label": 1},
          {"idx": [2, 9, 4, 3, 8], "segment_ids": [0, 0, 0, 1, 1], "mlm_labels": [IGNORE] * 5, "nsp_label": 0}]
    b = collate(ex, pad_id=0)
    assert b["idx"].tolist() == [[2, 4, 3, 0, 0], [2, 9, 4, 3, 8]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert b["mlm_labels"].tolist()[0] == [IGNORE, 7, IGNORE, IGNORE, IGNORE]
    assert b["nsp_labels"].tolist() == [1, 0]
    with pytest.raises(ValueError, match="pad_to=4 is shorter than the longest example \\(5"):
        collate(ex, 0, pad_to=4)


def test_bert_batches_from_instance_lengths():
    data = BertBatches(_toy_docs(), SPEC, max_seq_length=40, seed=2, short_seq_prob=0.5)
    assert all(len(e["idx"]) <= 40 for e in data.instances)
    assert isinstance(Instance([1], [0]), Instance)


# --- real tokenizers and real text ------------------------------------------------------------

GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@pytest.fixture(scope="module")
def gpt2_tok(data_dir):
    from duolm.tokenizers import ByteLevelBPE

    return ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")


@pytest.fixture(scope="module")
def bert_tok(data_dir):
    from duolm.tokenizers import WordPiece

    return WordPiece.from_vocab(data_dir / "bert-vocab" / "bert-base-uncased-vocab.txt")


def test_prepare_gpt2_chunks_encode_exactly_as_tiktoken_whole_files(tmp_path, data_dir, gpt2_tok):
    """Chunked, parallel encoding gives exactly tiktoken's ids of each whole file (+ <|endoftext|>)."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    ref = tiktoken.Encoding("gpt2-local", pat_str=GPT2_PAT, special_tokens={"<|endoftext|>": 50256},
                            mergeable_ranks=load_tiktoken_bpe(str(data_dir / "gpt2" / "gpt2.tiktoken")))
    files = []
    for name, src in [("shakespeare.txt", "tinyshakespeare/input.txt"), ("wiki.txt", "wikitext-2/valid.txt")]:
        raw = (data_dir / src).read_bytes()[:60_000].decode("utf-8", "ignore")
        (tmp_path / name).write_bytes(raw.encode("utf-8"))
        files.append(tmp_path / name)
    m = prepare(files, gpt2_tok, tmp_path / "d", workers=2, val_fraction=0, chunk_chars=1500)
    stream = np.concatenate(open_split(tmp_path / "d", "train"))
    want = [t for f in files for t in ref.encode_ordinary(f.read_text(encoding="utf-8")) + [50256]]
    assert stream.dtype == np.uint16 and stream.tolist() == want
    assert m["eot_id"] == 50256 and m["vocab_size"] == 50257 and m["splits"]["train"]["documents"] == 2
    # the saved tokenizer comes back from the data directory
    from duolm.tokenizers import load_tokenizer

    assert load_tokenizer(tmp_path / "d" / "tokenizer").encode_ordinary("Hello world") == ref.encode_ordinary("Hello world")


def test_prepare_wordpiece_ptb_and_bert_batches(tmp_path, data_dir, bert_tok):
    raw = (data_dir / "ptb" / "ptb.train.txt").read_text()[:150_000]
    raw = raw[:raw.rindex("\n") + 1]
    (tmp_path / "ptb.txt").write_text(raw)
    m = prepare([tmp_path / "ptb.txt"], bert_tok, tmp_path / "d", workers=2, val_fraction=0.1, chunk_chars=8000)
    assert m["kind"] == "wordpiece" and m["vocab_size"] == 30522 and m["dtype"] == "uint16"
    train, val = load_documents(tmp_path / "d", "train"), load_documents(tmp_path / "d", "val")
    # PTB has no blank lines: its sentences are cut into documents of about chunk_chars
    lines = [ln for ln in raw.split("\n") if ln.strip()]
    assert sum(len(d) for d in train + val) == len(lines) and len(val) >= 1 and len(train) > 10
    first = train[0]
    assert first[:50] == [[bert_tok.vocab[p] for p in bert_tok.tokenize(ln)] for ln in lines[:50]]
    spec = MaskSpec.from_tokenizer(bert_tok)
    assert spec.mask_id == bert_tok.mask_id and len(spec.subword_ids) > 5000
    data = BertBatches(train, spec, max_seq_length=64, seed=0, masking="dynamic", whole_word=True)
    b = data.batch(0, 16)
    chosen = b["mlm_labels"] != IGNORE
    assert b["idx"].shape[1] <= 64 and chosen.any()
    special = torch.tensor(sorted(spec.special_ids))
    assert not torch.isin(b["mlm_labels"][chosen], special).any()  # never a special token predicted
    assert ((b["idx"][chosen] == bert_tok.mask_id).float().mean() > 0.5)
    assert (b["idx"][:, 0] == bert_tok.cls_id).all() and set(b["nsp_labels"].tolist()) <= {0, 1}


def test_cli_prepare(tmp_path, data_dir, gpt2_tok, capsys):
    from duolm.cli import main

    gpt2_tok.save(tmp_path / "tok")
    text = (data_dir / "tinyshakespeare" / "input.txt").read_text()[:100_000]
    (tmp_path / "a.txt").write_text(text[:50_000])
    (tmp_path / "b.txt").write_text(text[50_000:])
    main(["prepare", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--tokenizer", str(tmp_path / "tok"),
          "-o", str(tmp_path / "data"), "--workers", "2", "--val-fraction", "0.1"])
    out = capsys.readouterr().out
    meta = load_meta(tmp_path / "data")
    assert meta["kind"] == "bpe" and meta["splits"]["val"]["tokens"] > 0
    assert f"train: {meta['splits']['train']['tokens']:,} tokens" in out and "bpe, vocab 50,257, uint16" in out
    assert (tmp_path / "data" / "tokenizer" / "merges.txt").is_file()
    data = CausalBatches(open_split(tmp_path / "data", "train"), 64, seed=0)
    assert data.batch(0, 4)["x"].shape == (4, 64)
    with pytest.raises(SystemExit):
        main(["prepare", str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x")])
    assert "nowhere" in capsys.readouterr().err
