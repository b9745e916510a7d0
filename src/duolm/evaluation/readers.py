"""Readers for the GPT-2 paper's evaluation sets, in the formats they are distributed in.

Each reader checks the format as it goes: a file of the wrong format (or an empty one) raises a
ValueError that names the task, the file and the line. Corpora are streamed line by line (or in
1 MiB blocks for enwik8 / text8), never read whole.

    WikiText (wiki.*.tokens / wiki.*.raw)   every line framed by spaces: " = Title = ", " tok tok "
    PTB (ptb.*.txt)                         the same framing, lower-case, <unk>, N for numbers
    1BW (news.en.heldout-*)                 one tokenized sentence per line, no framing
    enwik8 / text8                          raw bytes / a-z and spaces; the whole 10^8-byte file
                                            means its standard test split, the last 5,000,000
    LAMBADA                                 OpenAI's jsonl ({"text": ...} per line) or the original
                                            plain text (one tokenized passage per line)
    CBT (cbtest_*_2500ex.txt)               21 numbered lines per example, blank line between; line
                                            21: "question with XXXXX<TAB>answer<TAB><TAB>c1|...|c10"
    CoQA (coqa-dev-v1.0.json)               {"data": [{"story", "questions", "answers", ...}]}
    WMT (newstest2014-fren.{en,fr}.txt)     one segment per line, line i of each file aligned
    CNN/DailyMail (test.source)             one article per line (test.target: one summary per line)
"""
from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from duolm.evaluation.detok import detokenize_words

FULL_CORPUS = 100_000_000     # enwik8 / text8: 90M train, 5M valid, 5M test
TEST_SPLIT = 5_000_000


def is_path(data) -> bool:
    """A file name (str or Path) rather than examples already in memory."""
    return isinstance(data, (str, Path))


def _where(task: str, path, line: int | None = None) -> str:
    return f"{task}: {path}" + (f" line {line}" if line is not None else "")


def _open_text(path, task: str):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{task}: no such file {path}")
    if path.stat().st_size == 0:
        raise ValueError(f"{_where(task, path)} is empty")
    return open(path, encoding="utf-8", newline="\n")


def text_lines(path, task: str) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline), streamed; undecodable bytes name their line."""
    with _open_text(path, task) as f:
        n = 0
        while True:
            try:
                line = f.readline()
            except UnicodeDecodeError as e:
                raise ValueError(f"{_where(task, path, n + 1)}: not UTF-8 text ({e.reason})") from None
            if not line:
                return
            n += 1
            yield n, line[:-1] if line.endswith("\n") else line


def corpus_lines(path, task: str, framed: bool) -> Iterator[str]:
    """Lines of a tokenized corpus. framed: WikiText / PTB, every line " tok ... tok " (a blank line
    is " "); else (1BW) one non-empty sentence per line."""
    for n, line in text_lines(path, task):
        if framed and not (line == " " or (len(line) > 2 and line[0] == " " and line[-1] == " ")):
            raise ValueError(f"{_where(task, path, n)}: expected a line framed by spaces as in "
                             f"WikiText / PTB (' tok tok '), got {line[:50]!r}")
        if not framed and (not line.strip() or "\t" in line):
            raise ValueError(f"{_where(task, path, n)}: expected one tokenized sentence per line (1BW), "
                             f"got {'a blank line' if not line.strip() else 'a tab'}")
        yield line


def byte_blocks(path, task: str, text8: bool, block: int = 1 << 20) -> Iterator[bytes]:
    """enwik8 (any bytes) or text8 (a-z and spaces only), in blocks; the full 10^8-byte corpus is cut
    to its test split (the last 5,000,000 bytes)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{task}: no such file {path}")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{_where(task, path)} is empty")
    with open(path, "rb") as f:
        if size == FULL_CORPUS:
            f.seek(FULL_CORPUS - TEST_SPLIT)
        head = f.read(64)
        if not text8 and head[:1].isdigit() and head.replace(b" ", b"").replace(b"\n", b"").isdigit():
            raise ValueError(f"{_where(task, path, 1)}: byte values written as numbers (the prepared "
                             f"format of some training scripts); pass the raw enwik8 bytes")
        pos, line, nl = 0, 1, b"\n"
        while head:
            if text8:
                bad = head.translate(None, b"abcdefghijklmnopqrstuvwxyz \n")
                if bad:
                    at = head.index(bad[:1])
                    raise ValueError(f"{_where(task, path, line + head.count(nl, 0, at))}: byte "
                                     f"{pos + at} is {bad[:1]!r}; text8 holds only a-z and spaces")
            line += head.count(nl)
            pos += len(head)
            yield head
            head = f.read(block)


def decode_blocks(blocks) -> Iterator[str]:
    """UTF-8 text of a byte stream; a character split across blocks is joined, invalid bytes -> U+FFFD."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for b in blocks:
        yield dec.decode(b)
    yield dec.decode(b"", final=True)


# --- LAMBADA -------------------------------------------------------------------------------------------

@dataclass
class LambadaExample:
    """The passage without its last word, and the last word with the space before it (" word")."""
    context: str
    target: str


def lambada_examples(path, task: str = "lambada", detokenize: bool = True) -> list[LambadaExample]:
    """OpenAI's jsonl (detected by a first line starting with "{"; the text is used as is) or the
    original plain text, whose tokenization is undone when `detokenize` (the "books" rules)."""
    out, jsonl = [], None
    for n, line in text_lines(path, task):
        if jsonl is None:
            jsonl = line.lstrip().startswith("{")
        if jsonl:
            try:
                text = json.loads(line)["text"]
                if not isinstance(text, str):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{_where(task, path, n)}: expected a JSON object with a \"text\" string "
                                 f"(OpenAI's lambada_test.jsonl)") from None
            cut = text.rfind(" ")
        else:
            words = line.split(" ")
            if not line.strip() or "\t" in line or len(words) < 2:
                raise ValueError(f"{_where(task, path, n)}: expected one passage of two or more words per "
                                 f"line (LAMBADA plain text) or OpenAI's jsonl")
            if detokenize:
                text, starts = detokenize_words(words, "books")
                cut = starts[-1] - (text[starts[-1] - 1] == " ")
            else:
                text, cut = line, line.rfind(" ")
        if cut <= 0:
            raise ValueError(f"{_where(task, path, n)}: the passage has no context before its last word")
        out.append(LambadaExample(text[:cut], text[cut:]))
    return out


# --- CBT -----------------------------------------------------------------------------------------------

@dataclass
class CBTExample:
    """20 context sentences and the question, as tokens; the question holds "XXXXX" at the blank."""
    context: list[str]
    question: list[str]
    answer: str
    candidates: list[str]


def cbt_examples(path, task: str = "cbt") -> list[CBTExample]:
    out, context = [], []
    fmt = "21 numbered lines per example (CBT), line 21 'question<TAB>answer<TAB><TAB>c1|c2|...'"
    for n, line in text_lines(path, task):
        if not line.strip():
            if context:
                raise ValueError(f"{_where(task, path, n)}: blank line inside an example; expected {fmt}")
            continue
        num, _, rest = line.partition(" ")
        if not num.isdigit() or int(num) != len(context) + 1 or int(num) > 21:
            raise ValueError(f"{_where(task, path, n)}: expected line number {len(context) + 1} of {fmt}")
        if int(num) < 21:
            context.append(rest)
            continue
        fields = rest.split("\t")
        cands = fields[3].split("|") if len(fields) == 4 else []
        if len(fields) != 4 or "XXXXX" not in fields[0].split() or fields[1] not in cands or len(cands) < 2:
            raise ValueError(f"{_where(task, path, n)}: expected 'question with XXXXX<TAB>answer<TAB><TAB>"
                             f"candidates separated by |' with the answer among the candidates")
        out.append(CBTExample(" ".join(context).split(), fields[0].split(), fields[1], cands))
        context = []
    if context:
        raise ValueError(f"{_where(task, path)}: the file ends inside an example; expected {fmt}")
    return out


# --- prompted tasks ------------------------------------------------------------------------------------

def plain_lines(path, task: str) -> list[str]:
    """One non-empty segment / article per line."""
    out = []
    for n, line in text_lines(path, task):
        if not line.strip():
            raise ValueError(f"{_where(task, path, n)}: blank line; expected one segment per line")
        out.append(line.strip())
    return out


def coqa_stories(path, task: str = "coqa") -> list[dict]:
    """CoQA's json -> [{"story": str, "turns": [(question, [gold answers])]}]; the gold answers are the
    main answer plus those in "additional_answers" (dev set) for the same turn."""
    with _open_text(path, task) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{_where(task, path, e.lineno)}: not JSON ({e.msg}); expected CoQA's json") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{_where(task, path)}: not UTF-8 text ({e.reason})") from None
    out = []
    for k, item in enumerate(data.get("data", []) if isinstance(data, dict) else []):
        try:
            extra = item.get("additional_answers", {}).values()
            turns = []
            for i, (q, a) in enumerate(zip(item["questions"], item["answers"], strict=True)):
                golds = [a["input_text"]] + [alt[i]["input_text"] for alt in extra]
                turns.append((q["input_text"], golds))
            out.append({"story": item["story"], "turns": turns})
        except (KeyError, TypeError, IndexError, ValueError, AttributeError):
            raise ValueError(f"{_where(task, path)}: story {k} is not a CoQA item (story, questions and "
                             f"answers with input_text, one answer per question)") from None
    if not out:
        raise ValueError(f"{_where(task, path)}: no stories; expected CoQA's json {{\"data\": [...]}}")
    return out
