"""Subcommands that make and use models: tokenizer, convert, prepare, pretrain, generate, fill-mask, serve, demo,
env."""
from __future__ import annotations

import sys
from pathlib import Path

from duolm.cli.options import Progress, add_options, add_precision, for_inference, options, report_compile


def cmd_tokenizer_train(args):
    from tqdm import tqdm

    from duolm.tokenizers import train_tokenizer

    with tqdm(total=0, desc=f"{args.kind} merges", unit="merge", dynamic_ncols=True) as bar:
        tok = train_tokenizer(args.kind, args.files, args.vocab_size, min_frequency=args.min_frequency,
                              lowercase=not args.cased, progress=lambda done, total:
                              (setattr(bar, "total", total), bar.update(done - bar.n)))
    tok.save(args.out)
    print(f"trained {args.kind} tokenizer: vocab {tok.vocab_size} (asked {args.vocab_size}) from "
          f"{len(args.files)} file(s) -> {args.out}")


def cmd_tokenizer_encode(args):
    from duolm.tokenizers import load_tokenizer, show_pieces

    ids, pieces = show_pieces(load_tokenizer(args.dir), args.text, allow_special=args.allow_special)
    print("ids:   ", ids, "\npieces:", pieces, "\nrule:   special tokens typed in the text are " +
          ("encoded as special" if args.allow_special else "plain text (--allow-special to encode them as special)"))


def add_tokenizer(sub):
    p = sub.add_parser("tokenizer", help="train or use a tokenizer")
    tsub = p.add_subparsers(dest="tokenizer_cmd", required=True)
    t = tsub.add_parser("train", help="train a byte-level BPE or WordPiece tokenizer on text files")
    t.add_argument("--kind", choices=["bpe", "wordpiece"], required=True)
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--min-frequency", type=int, default=2)
    t.add_argument("--cased", action="store_true", help="WordPiece: keep case and accents")
    t.add_argument("files", nargs="+")
    t.add_argument("-o", "--out", required=True, help="output directory")
    t.set_defaults(func=cmd_tokenizer_train)
    e = tsub.add_parser("encode", help="print the ids and pieces of a text")
    e.add_argument("dir")
    e.add_argument("text")
    e.add_argument("--allow-special", action="store_true", help="encode typed special tokens as special")
    e.set_defaults(func=cmd_tokenizer_encode)


def cmd_convert(args):
    from duolm.checkpoint import load, save
    from duolm.convert.st import read_pooling
    from duolm.models import Bert
    from duolm.models.heads import MAX_LENGTH, HeadConfig, attach_head

    if args.to != "onnx" and (args.quantize or args.no_cache):
        raise ValueError(f"--quantize and --no-cache are options of --to onnx, not --to {args.to}")
    model, tok = load(args.src)
    pooling = read_pooling(args.src) if args.to == "onnx" and type(model) is Bert else None
    if pooling is not None and pooling.source:      # a sentence-transformers checkpoint: the embedding its modules make
        model = attach_head(model, HeadConfig("embed", max_length=pooling.max_length or MAX_LENGTH, pooling=pooling.mode,
                                              normalize=pooling.normalize))
    out = save(model, args.dst, tokenizer=tok, format=args.to, cache=not args.no_cache)
    n = sum(p.numel() for p in model.parameters())
    what = type(model).__name__ + (f" + {type(tok).__name__}" if tok is not None else " (no tokenizer)")
    print(f"wrote {out} ({args.to} format): {what}, {n:,} parameters")
    if args.quantize:
        from duolm.convert.onnx import quantize

        for a in quantize(model, out, cache=not args.no_cache):
            top1 = "" if a.top1 is None else f", argmax as fp32's in {100 * a.top1:.1f}% of rows"
            print(f"int8 {out / 'onnx' / a.file}: {a.output} cosine to fp32 >= {a.cosine:.4f}{top1} (sample inputs)")


def add_convert(sub):
    p = sub.add_parser("convert", help="convert a model directory between duolm and Hugging Face formats, or to ONNX")
    p.add_argument("src", help="duolm, Hugging Face (gpt2/bert), original TensorFlow release or training-run "
                               "directory, or a model name in the local Hugging Face cache (e.g. gpt2)")
    p.add_argument("dst", help="output directory (created; files in it are replaced)")
    p.add_argument("--to", choices=["duolm", "hf", "onnx"], default="duolm",
                   help="output format (default: duolm); onnx: the HF files with onnx/model.onnx, checked in ONNX "
                        "Runtime (the onnx extra; docs/deployment.md)")
    p.add_argument("--quantize", choices=["int8"], help="--to onnx: also onnx/*_quantized.onnx, ONNX Runtime's dynamic "
                                                        "int8, with its agreement with fp32")
    p.add_argument("--no-cache", action="store_true", help="--to onnx, a GPT-2 LM: a graph without the KV cache "
                                                           "(input ids and mask -> logits)")
    p.set_defaults(func=cmd_convert)


def cmd_prepare(args):
    from tqdm import tqdm

    from duolm.data import prepare
    from duolm.tokenizers import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    with tqdm(total=0, unit="B", unit_scale=True, desc="tokenizing", dynamic_ncols=True, disable=args.quiet) as bar:
        meta = prepare(args.files, tok, args.out, workers=args.workers, val_fraction=args.val_fraction,
                       shard_size=args.shard_size, progress=lambda done, total:
                       (setattr(bar, "total", total), bar.update(done - bar.n)))
    for split, m in meta["splits"].items():
        extra = f", {m['sentences']:,} sentences" if "sentences" in m else ""
        print(f"{split}: {m['tokens']:,} tokens, {m['documents']:,} documents{extra} in {len(m['shards'])} shard(s)")
    print(f"wrote {args.out} ({meta['kind']}, vocab {meta['vocab_size']:,}, {meta['dtype']}) from "
          f"{meta['bytes'] / 1e6:.1f} MB of text")


def add_prepare(sub):
    import os

    p = sub.add_parser("prepare", help="tokenize text files into token shards with a validation split",
                       description="Byte-level BPE: each file is a document, ended by <|endoftext|>. WordPiece (BERT): "
                                   "one sentence per line, a blank line between documents.")
    p.add_argument("files", nargs="+", help="UTF-8 text files")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (vocab.json + merges.txt, or vocab.txt)")
    p.add_argument("-o", "--out", required=True, help="output directory")
    p.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="encoding processes")
    p.add_argument("--val-fraction", type=float, default=0.005, help="share of the text held out for validation")
    p.add_argument("--shard-size", type=int, default=100_000_000, help="tokens per shard")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_prepare)


def cmd_pretrain(args):
    from duolm.train import ModelConfig, TrainConfig, pretrain

    progress = Progress(f"{args.family} {args.preset} -> {args.out}", args.max_steps, args.quiet, args.family == "gpt2")
    try:
        r = pretrain(args.family, args.data, args.out, options(ModelConfig, args), options(TrainConfig, args),
                     resume=args.resume, device=args.device, on_start=progress.start, on_log=progress)
    finally:
        progress.close()
    if progress.bar is not None:
        print(f"{'stopped by SIGTERM' if r['stopped'] else 'done'} at step {r['step']}; checkpoint "
              f"{args.out}/ckpt-{r['saved_at']:08d}; metrics {args.out}/metrics.jsonl"
              + (f"; loss curve {r['plot']}" if r.get("plot") else ""))


def add_pretrain(sub):
    from duolm.train import ModelConfig, TrainConfig

    p = sub.add_parser("pretrain", help="pretrain GPT-2 (causal LM) or BERT (MLM + NSP) on prepared data",
                       description="Same command on one CPU or under torchrun on many GPUs (DDP).")
    p.add_argument("family", choices=["gpt2", "bert"])
    p.add_argument("--data", required=True, help="directory written by `duolm prepare`")
    p.add_argument("-o", "--out", required=True, help="run folder: checkpoints, metrics.jsonl, tb/, loss.png")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in -o")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_options(p.add_argument_group("model"), ModelConfig)
    add_options(p.add_argument_group("training"), TrainConfig)
    p.set_defaults(func=cmd_pretrain)


def cmd_generate(args):
    from duolm.checkpoint import load
    from duolm.generation import StopReason
    from duolm.generation.grammar import Grammar
    from duolm.textgen import generate_text

    grammar = (Grammar("choice", args.choice) if args.choice else Grammar("regex", args.regex) if args.regex else
               Grammar("json", Path(args.json_schema).read_text(encoding="utf-8")) if args.json_schema else None)
    model, tok = load(args.dir)
    for_inference(model, args)
    gen = generate_text(model, tok, args.prompt, args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                        num_beams=args.num_beams, length_penalty=args.length_penalty, stop=args.stop or (),
                        seed=args.seed, truncation=args.truncate, allow_special=args.allow_special,
                        compile=args.compile, grammar=grammar)
    if gen.truncated_from:
        print(f"duolm: prompt truncated on the left from {gen.truncated_from} to {len(gen.prompt_ids)} tokens",
              file=sys.stderr)
    sys.stdout.write(args.prompt)
    for piece in gen:
        sys.stdout.write(piece)
        if args.stream:
            sys.stdout.flush()
    print()
    if args.compile:
        report_compile(model)
    if gen.stop_reason == StopReason.CONTEXT:
        print(f"duolm: stopped: the context window of {model.config.block_size} tokens is full", file=sys.stderr)


def add_generate(sub):
    p = sub.add_parser("generate", help="continue a prompt with a GPT-2 model",
                       description="Prints the prompt and its continuation; stops at <|endoftext|>, a --stop "
                                   "string, --max-new-tokens or the end of the context window.")
    p.add_argument("dir", help="model directory (duolm, Hugging Face, TensorFlow release, or a training run) "
                               "or a model name in the local Hugging Face cache")
    p.add_argument("prompt", help="text to continue (may be empty: then it starts from <|endoftext|>)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default: 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus: the smallest set with this probability mass")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL's penalty on seen tokens (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--stream", action="store_true", help="print the text as it is produced")
    p.add_argument("--stop", action="append", metavar="STRING", help="stop before this text (repeatable)")
    p.add_argument("--num-beams", type=int, default=1, help="beam search with N beams (no sampling, no streaming)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam score = logprob / length ** this")
    p.add_argument("--truncate", choices=["none", "left"], default="none",
                   help="left: drop the oldest prompt tokens so prompt + new tokens fit the context window")
    p.add_argument("--allow-special", action="store_true",
                   help="encode special tokens typed in the prompt (<|endoftext|>) as special, not as text")
    p.add_argument("--compile", action="store_true",
                   help="decode through one static-shape step compiled with torch.compile (a CUDA graph on GPUs; "
                        "ahead of time by AOTInductor on CPUs); "
                        "pays a compilation first (printed), see docs/benchmarks.md for when it pays")
    shape = p.add_mutually_exclusive_group()      # structured output (the 'grammar' extra)
    shape.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    shape.add_argument("--regex", help="the output matches this regular expression (Rust's regex syntax)")
    shape.add_argument("--json-schema", metavar="FILE", help="the output is compact JSON valid under this JSON schema")
    add_precision(p)
    p.set_defaults(func=cmd_generate)


def cmd_fill_mask(args):
    from duolm.checkpoint import load
    from duolm.textgen import fill_mask_text

    model, tok = load(args.dir)
    for_inference(model, args)
    results, filled = fill_mask_text(model, tok, args.text, top_k=args.top_k)
    for n, fillers in enumerate(results, 1):
        print(f"[MASK] {n}:" if len(results) > 1 else "[MASK]:")
        width = max(len(piece) for piece, _ in fillers)
        for piece, p in fillers:
            print(f"  {piece:<{width}}  {p:.4f}")
    print(filled)


def add_fill_mask(sub):
    p = sub.add_parser("fill-mask", help="fill [MASK] with a BERT model's top predictions")
    p.add_argument("dir", help="model directory with a masked-LM head and vocab.txt")
    p.add_argument("text", help='text with one or more [MASK], e.g. "The capital of France is [MASK]."')
    p.add_argument("--top-k", type=int, default=5, help="fillers shown per mask (default 5)")
    add_precision(p)
    p.set_defaults(func=cmd_fill_mask)


def cmd_serve(args):
    from duolm.serve import ServeConfig, read_api_key, run

    config = options(ServeConfig, args)
    config.api_key = read_api_key(args.api_key_file) if args.api_key_file else args.api_key
    try:
        run(args.dir, config)
    except ImportError as e:            # the 'serve' extra is not installed: one line, not a traceback
        raise ValueError(str(e)) from None


def add_serve(sub):
    from duolm.serve import ServeConfig

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (extra: duolm[serve])",
                       description="GPT-2: /v1/completions; BERT: /v1/embeddings and /v1/fill-mask; both: "
                                   "/v1/models, /health, /metrics, /tokenize, /detokenize, /tokenizer_info. "
                                   "SIGTERM lets in-flight requests finish.")
    p.add_argument("dir", help="model directory (duolm, Hugging Face, or a training run)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (visible in ps: prefer --api-key-file)")
    key.add_argument("--api-key-file", help="file holding the API key")
    add_options(p, ServeConfig)
    p.set_defaults(func=cmd_serve)


def cmd_demo(args):
    from duolm.demo import run
    steps = {k: getattr(args, k) for k in ("gpt2_steps", "bert_steps") if getattr(args, k) is not None}
    run(args.out, text=args.text, **steps)


def add_demo(sub):
    p = sub.add_parser("demo", help="train a small GPT-2 and BERT from scratch on the stdlib's docstrings (no download)")
    p.add_argument("--text", default=None, help="your own text file instead (blank lines separate documents)")
    p.add_argument("-o", "--out", default="runs/demo")
    p.add_argument("--gpt2-steps", type=int, help="GPT-2's training steps (400)")
    p.add_argument("--bert-steps", type=int, help="BERT's training steps (3000)")
    p.set_defaults(func=cmd_demo)


def cmd_env(args):
    import json

    from duolm.precision import engines_report
    r = engines_report()
    if args.json:
        print(json.dumps(r, indent=1))
        return
    m = r["machine"]
    print(f"CPU: {m['cpu']} ({m['capability']}, {m['threads']} threads, native bf16: {m['native_bf16']})")
    for kind in ("fp32", "int8"):
        c = r[kind]
        print(f"{kind}: {c['few']} up to 32 rows, {c['wide']} above (timed on this machine, key {c['key']})")
        for name, times in c["times"].items():
            print(f"  {name:>12}: " + ", ".join(f"{rows} rows {t * 1e3:.2f} ms" for rows, t in times.items()))
    print(f"attention (decoding): {r['attention']}")


def add_env(sub):
    p = sub.add_parser("env", help="print the engines that run the matmuls on this CPU, timed once on the machine")
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.set_defaults(func=cmd_env)
