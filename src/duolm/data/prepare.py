"""`duolm prepare`: text files -> token shards with a held-out validation split (worker processes).

The shard format and the prepared directory's layout are duolm.data.shards'; this module only fills
them. The text is cut where the tokenizer says a cut changes no id, so chunks encode in parallel.
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import regex

from duolm.data.shards import FORMAT, VERSION, dtype_for_vocab, write_shard
from duolm.fileio import atomic_write, write_json
from duolm.tokenizers.files import ENDOFTEXT


# --- prepare: text files -> shards --------------------------------------------------------------

def _wordpiece_chunks(text: str, chunk_chars: int) -> list[str]:
    """Whole documents (blank-line separated) grouped into chunks of at most about chunk_chars; a document
    longer than chunk_chars is cut at line ends into several documents."""
    out: list[str] = []
    cur: list[str] = []
    size = 0       # characters in cur
    doc_start = 0  # where the current document starts in cur
    doc_chars = 0  # characters of the current document
    for line in text.split("\n"):
        n = len(line) + 1
        if not line.strip():
            cur.append(line)
            size += n
            doc_start, doc_chars = len(cur), 0
            continue
        if doc_chars and doc_chars + n > chunk_chars:  # the document alone is too long: cut it here
            out.append("\n".join(cur))
            cur, size, doc_start, doc_chars = [], 0, 0, 0
        elif doc_start and size + n > chunk_chars:  # move the current document to a new chunk
            out.append("\n".join(cur[:doc_start]))
            cur, size, doc_start = cur[doc_start:], doc_chars, 0
        cur.append(line)
        size += n
        doc_chars += n
    out.append("\n".join(cur))
    return [c for c in out if c.strip()]


def _encode_chunk(tok, kind: str, text: str):
    """ids of a chunk in the shard dtype (half or quarter of int64's bytes to send back from a worker);
    WordPiece also: tokens per sentence, sentences per document."""
    dtype = dtype_for_vocab(tok.vocab_size)
    if kind == "bpe":
        return np.asarray(tok.encode_ordinary(text), dtype=dtype), None, None
    ids, sent_lens, doc_sents = [], [], []
    n = 0
    vocab, unk = tok.vocab, tok.unk_id
    for line in text.split("\n") + [""]:
        if not line.strip():
            if n:
                doc_sents.append(n)
                n = 0
            continue
        sent = [vocab.get(p, unk) for p in tok.tokenize(line)]
        if sent:
            ids.extend(sent)
            sent_lens.append(len(sent))
            n += 1
    return (np.asarray(ids, dtype=dtype), np.asarray(sent_lens, dtype=np.int64),
            np.asarray(doc_sents, dtype=np.int64))


def _save_npy(path, array):
    with open(path, "wb") as f:   # np.save(str) would append ".npy" to the temp name
        np.save(f, array)


_SHARD_NAME = regex.compile(r"(train|val)_\d{6}\.(bin|sent\.npy|doc\.npy)")
_WORKER: dict = {}


def _worker_init(tok, kind, texts):
    _WORKER.update(tok=tok, kind=kind, texts=texts)


def _worker_encode(task):
    """Encode chunk `task`: an index into the inherited texts (fork), or the text itself (spawn)."""
    text = task if isinstance(task, str) else _WORKER["texts"][task]
    return _encode_chunk(_WORKER["tok"], _WORKER["kind"], text)


class _ShardWriter:
    """Collects encoded chunks of one split and writes a shard whenever shard_size tokens are buffered."""

    def __init__(self, out_dir: Path, split: str, kind: str, vocab_size: int, shard_size: int):
        self.out_dir, self.split, self.kind = out_dir, split, kind
        self.vocab_size, self.shard_size = vocab_size, shard_size
        self.shards: list[str] = []
        self.tokens = self.documents = self.sentences = 0
        self._ids: list[np.ndarray] = []
        self._sent: list[np.ndarray] = []
        self._docs: list[np.ndarray] = []
        self._n = 0

    def add(self, ids, sent_lens=None, doc_sents=None):
        self._ids.append(ids)
        self._n += len(ids)
        self.tokens += len(ids)
        if self.kind == "bpe":
            while self._n >= self.shard_size:  # a token stream may be cut anywhere
                flat = np.concatenate(self._ids)
                self._write(flat[:self.shard_size])
                self._ids, self._n = [flat[self.shard_size:]], len(flat) - self.shard_size
        else:  # chunks hold whole documents: cut only between chunks
            self._sent.append(sent_lens)
            self._docs.append(doc_sents)
            self.sentences += len(sent_lens)
            self.documents += len(doc_sents)
            if self._n >= self.shard_size:
                self.flush()

    def _write(self, ids):
        name = f"{self.split}_{len(self.shards):06d}.bin"
        write_shard(self.out_dir / name, ids, self.vocab_size)
        self.shards.append(name)

    def flush(self):
        """Write what is buffered (an empty split still gets one empty shard, so every split opens)."""
        if self._n == 0 and self.shards:
            self._ids, self._sent, self._docs = [], [], []
            return
        ids = np.concatenate(self._ids) if self._ids else np.zeros(0, dtype=np.int64)
        self._write(ids)
        if self.kind == "wordpiece":
            base = self.out_dir / self.shards[-1]
            sent_lens = np.concatenate(self._sent) if self._sent else np.zeros(0, dtype=np.int64)
            doc_sents = np.concatenate(self._docs) if self._docs else np.zeros(0, dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(sent_lens)]).astype(np.int64)
            dstarts = np.concatenate([[0], np.cumsum(doc_sents)]).astype(np.int64)
            atomic_write(base.with_suffix(".sent.npy"), lambda tmp: _save_npy(tmp, starts))
            atomic_write(base.with_suffix(".doc.npy"), lambda tmp: _save_npy(tmp, dstarts))
            self._sent, self._docs = [], []
        self._ids, self._n = [], 0

    def meta(self) -> dict:
        m = {"shards": self.shards, "tokens": int(self.tokens), "documents": int(self.documents)}
        if self.kind == "wordpiece":
            m["sentences"] = int(self.sentences)
        return m


def _choose_val(sizes: Sequence[int], val_fraction: float) -> list[bool]:
    """Which chunks are held out: error diffusion over chunk sizes, so about val_fraction of the text,
    spread evenly through the corpus, whole chunks only."""
    is_val, debt = [], 0.0
    for n in sizes:
        debt += val_fraction * n
        take = val_fraction > 0 and debt >= n / 2
        if take:
            debt -= n
        is_val.append(take)
    if val_fraction > 0 and not any(is_val):
        if len(sizes) < 2:
            raise ValueError(f"corpus too small for a validation split: it is one chunk of {sum(sizes)} characters; "
                             f"pass val_fraction=0, a smaller chunk_chars, or more text")
        is_val[-1] = True
    return is_val


def prepare(files: Iterable, tokenizer, out_dir, *, workers: int = 1, val_fraction: float = 0.005,
            shard_size: int = 100_000_000, chunk_chars: int = 1 << 16,
            progress: Callable[[int, int], None] | None = None) -> dict:
    """Tokenize text files into token shards with a held-out validation split; returns the meta dict.

    The text is cut into chunks of about `chunk_chars` characters (independent of `workers`, so any
    number of workers writes the same bytes); `workers` processes encode chunks, results are written in
    order. About `val_fraction` of the chunks, spread evenly, form the val split. Byte-level BPE: each
    file is a document followed by the end-of-text id (also where a held-out chunk cuts a document).
    WordPiece: chunks hold whole documents (blank-line separated; a longer document is cut at a line end).
    `progress(done_bytes, total_bytes)` is called after each chunk (input UTF-8 bytes)."""
    files = [Path(f) for f in files]
    if not files:
        raise ValueError("prepare: no input files given")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if workers < 1 or shard_size < 1 or chunk_chars < 1:
        raise ValueError(f"workers ({workers}), shard_size ({shard_size}) and chunk_chars ({chunk_chars}) must be >= 1")
    kind = tokenizer.kind
    vocab_size = int(tokenizer.vocab_size)
    eot = tokenizer.special_tokens.get(ENDOFTEXT) if kind == "bpe" else None
    if kind == "bpe" and eot is None:
        raise ValueError("the BPE tokenizer has no <|endoftext|> token to separate documents; "
                         "train it with special_tokens=('<|endoftext|>',)")
    chunks = _chunks(files, tokenizer, chunk_chars)
    sizes = [len(c.encode("utf-8")) for _, c in chunks]
    total = sum(sizes)
    is_val = _choose_val([len(c) for _, c in chunks], val_fraction)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").unlink(missing_ok=True)  # the directory is incomplete until the new meta is written
    writers = {s: _ShardWriter(out_dir, s, kind, vocab_size, shard_size) for s in ("train", "val")}
    done = 0
    with _encoded(tokenizer, [c for _, c in chunks], workers) as results:
        tokenizer.save(out_dir / "tokenizer")   # here, while the workers encode (the main process is idle)
        for i, (ids, sent_lens, doc_sents) in enumerate(results):
            split = "val" if is_val[i] else "train"
            if kind == "bpe":
                last_of_doc = i + 1 == len(chunks) or chunks[i + 1][0] != chunks[i][0]
                if last_of_doc or is_val[i + 1] != is_val[i]:
                    ids = np.append(ids, np.asarray(eot, dtype=ids.dtype))
                    writers[split].documents += 1  # counts end-of-text ids: documents and cut pieces
                writers[split].add(ids)
            else:
                writers[split].add(ids, sent_lens, doc_sents)
            done += sizes[i]
            if progress is not None:
                progress(done, total)
    for w in writers.values():
        w.flush()

    meta = {"format": FORMAT, "version": VERSION, "kind": kind, "vocab_size": vocab_size,
            "dtype": dtype_for_vocab(vocab_size).name, "files": [str(f) for f in files], "bytes": total,
            "val_fraction": val_fraction, "chunk_chars": chunk_chars,
            "splits": {s: w.meta() for s, w in writers.items()}}
    if kind == "bpe":
        meta["eot_id"] = int(eot)
    else:
        meta.update(cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id, mask_id=tokenizer.mask_id,
                    pad_id=tokenizer.pad_id, unk_id=tokenizer.unk_id)
    write_json(out_dir / "meta.json", meta, indent=1)
    # shards of an earlier, bigger run in the same directory
    keep = {n for w in writers.values() for n in w.shards}
    for p in out_dir.iterdir():
        if _SHARD_NAME.fullmatch(p.name) and p.name.split(".")[0] + ".bin" not in keep:
            p.unlink()
    return meta


def _chunks(files: list[Path], tokenizer, chunk_chars: int) -> list[tuple[int, str]]:
    """(document number, text) of every chunk of the files, in order; the document number tells where a BPE
    end-of-text goes (see prepare)."""
    chunks: list[tuple[int, str]] = []
    for doc, f in enumerate(files):
        if not f.is_file():
            raise FileNotFoundError(f"input file {f} does not exist")
        try:
            text = f.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{f} is not UTF-8 text ({e}); convert it first") from None
        if tokenizer.kind == "bpe":
            if text:
                chunks.extend((doc, c) for c in tokenizer.safe_chunks(text, chunk_chars))
        else:
            text = text.replace("\r\n", "\n")
            chunks.extend((doc, c) for c in _wordpiece_chunks(text, chunk_chars))
    if not chunks:
        raise ValueError(f"prepare: the input files ({len(files)}) hold no text")
    return chunks


@contextmanager
def _encoded(tokenizer, texts: list[str], workers: int) -> Iterator[Iterable]:
    """The encoded chunks of `texts` in order (_encode_chunk's results), made here (workers == 1) or by a pool
    of `workers` processes, shut down on leaving."""
    kind = tokenizer.kind
    if workers == 1:  # no pool: encode here
        yield (_encode_chunk(tokenizer, kind, t) for t in texts)
        return
    # Forked workers inherit the tokenizer and the text, so a task is just a chunk number; with spawn
    # (Windows) the tokenizer is pickled once per worker and each chunk's text is sent. A result is
    # the chunk's ids in the shard dtype (2 bytes a token). (An executor rather than a
    # multiprocessing.Pool: the Pool's worker-handler thread spins while a result waits to be read.)
    fork = "fork" in multiprocessing.get_all_start_methods()
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("fork" if fork else "spawn"),
                               initializer=_worker_init, initargs=(tokenizer, kind, texts if fork else None))
    try:
        yield pool.map(_worker_encode, range(len(texts)) if fork else texts)
    finally:
        pool.shutdown(cancel_futures=True)
