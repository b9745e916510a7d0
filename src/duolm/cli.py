"""The `duolm` command. Each subcommand wires library calls together; printing happens here only."""
from __future__ import annotations

import argparse
import sys


# --- tokenizer --------------------------------------------------------------------------------

def cmd_tokenizer_train(args):
    import time
    from pathlib import Path
    from duolm.tokenizers import ByteLevelBPE, WordPiece

    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"no such file: {', '.join(missing)}")

    def lines():  # streamed, line by line
        for f in args.files:
            with open(f, encoding="utf-8", errors="replace") as fh:
                yield from fh

    t0 = time.perf_counter()
    if args.kind == "bpe":
        tok = ByteLevelBPE.train(lines(), args.vocab_size, min_frequency=args.min_frequency, progress=True)
    else:
        tok = WordPiece.train(lines(), args.vocab_size, lowercase=not args.cased, progress=True,
                              min_frequency=args.min_frequency)
    tok.save(args.out)
    mb = sum(Path(f).stat().st_size for f in args.files) / 1e6
    print(f"trained {args.kind} tokenizer: vocab {tok.vocab_size} (asked {args.vocab_size}) from {len(args.files)} "
          f"file(s), {mb:.1f} MB, in {time.perf_counter() - t0:.1f} s -> {args.out}")


def cmd_tokenizer_encode(args):
    from duolm.tokenizers import ByteLevelBPE, load_tokenizer

    tok = load_tokenizer(args.dir)
    if tok is None:
        raise FileNotFoundError(f"{args.dir} holds no tokenizer: expected vocab.json + merges.txt (BPE) or vocab.txt "
                                f"(WordPiece); make one with `duolm tokenizer train`")
    if isinstance(tok, ByteLevelBPE):
        ids = tok.encode(args.text, allowed_special="all")
        pieces = [tok.decode_bytes([i]) for i in ids]  # text, or the bytes of a piece of a character
        pieces = [p.decode() if p.decode(errors="replace") == p.decode(errors="ignore") else str(p) for p in pieces]
    else:
        ids = tok.encode(args.text).ids
        pieces = [tok.inv[i] for i in ids]
    print("ids:   ", ids)
    print("pieces:", pieces)


def _add_tokenizer(sub):
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
    e.set_defaults(func=cmd_tokenizer_encode)


# --- convert ----------------------------------------------------------------------------------

def cmd_convert(args):
    from duolm.checkpoint import load, save

    model, tok = load(args.src)
    out = save(model, args.dst, tokenizer=tok, format=args.to)
    n = sum(p.numel() for p in model.parameters())
    what = type(model).__name__ + (f" + {type(tok).__name__}" if tok is not None else " (no tokenizer)")
    print(f"wrote {out} ({args.to} format): {what}, {n:,} parameters")


def _add_convert(sub):
    p = sub.add_parser("convert", help="convert a model directory between duolm and Hugging Face formats")
    p.add_argument("src", help="duolm, Hugging Face (gpt2/bert) or training-run directory")
    p.add_argument("dst", help="output directory (created; files in it are replaced)")
    p.add_argument("--to", choices=["duolm", "hf"], default="duolm", help="output format (default: duolm)")
    p.set_defaults(func=cmd_convert)


# --- pretrain ---------------------------------------------------------------------------------

def _distributed_setup(device_arg):
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: join the process group (NCCL on GPU, gloo on CPU)."""
    import os

    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() if device_arg is None else device_arg.startswith("cuda")
    device = torch.device(device_arg or ("cuda" if cuda else "cpu"))
    if world > 1:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
    return device, (dist.get_rank() if world > 1 else 0)


def _pretrain_model_and_data(args, data_dir):
    """The model (fresh, seeded), the train/val batch sources, the objective and the tokenizer of a run."""
    import torch

    from duolm.data import CausalBatches, load_meta, load_tokenizer, open_split
    from duolm.models import GPT2, BertConfig, BertForPreTraining, GPT2Config
    from duolm.train import CAUSAL_LM, MLM_NSP

    meta = load_meta(data_dir)
    tok = load_tokenizer(data_dir / "tokenizer")
    want = "bpe" if args.family == "gpt2" else "wordpiece"
    if meta["kind"] != want:
        raise ValueError(f"{data_dir} holds {meta['kind']} data; `duolm pretrain {args.family}` needs data prepared "
                         f"with a {want} tokenizer (duolm tokenizer train --kind {want})")
    overrides = {"vocab_size": meta["vocab_size"]}
    if args.block_size:
        overrides["block_size"] = args.block_size
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    for name in ("n_layer", "n_head", "n_embd"):
        if getattr(args, name):
            overrides[name] = getattr(args, name)
    if args.family == "bert" and args.n_embd:
        overrides["n_inner"] = 4 * args.n_embd
    torch.manual_seed(args.seed)                     # the initial weights are a function of --seed
    if args.family == "gpt2":
        config = GPT2Config.preset(args.preset or "tiny", pad_vocab_multiple=64, **overrides)
        model = GPT2(config)
        train_data = CausalBatches(open_split(data_dir, "train"), config.block_size, seed=args.seed,
                                   order=args.order)
        val_data = CausalBatches(open_split(data_dir, "val"), config.block_size, order="sequential")
        return model, CAUSAL_LM, train_data, val_data, tok
    from duolm.data import BertBatches, MaskSpec, load_documents

    config = BertConfig.preset(args.preset or "tiny", pad_token_id=tok.pad_id, **overrides)
    model = BertForPreTraining(config)
    spec = MaskSpec.from_tokenizer(tok)
    common = dict(max_seq_length=config.block_size, nsp=not args.no_nsp, short_seq_prob=args.short_seq_prob,
                  masked_lm_prob=args.masked_lm_prob, max_predictions_per_seq=args.max_predictions,
                  whole_word=args.whole_word)
    train_data = BertBatches(load_documents(data_dir, "train"), spec, seed=args.seed, masking=args.masking,
                             dupe_factor=args.dupe_factor, **common)
    val_data = BertBatches(load_documents(data_dir, "val"), spec, seed=args.seed + 1, masking="static", **common)
    return model, MLM_NSP, train_data, val_data, tok


def cmd_pretrain(args):
    import math
    from pathlib import Path

    import torch.distributed as dist
    from tqdm import tqdm

    from duolm.train import TrainConfig, read_manifest, train

    data_dir, out = Path(args.data), Path(args.out)
    device, rank = _distributed_setup(args.device)
    model, objective, train_data, val_data, tok = _pretrain_model_and_data(args, data_dir)
    model.to(device)
    cfg = TrainConfig(max_steps=args.max_steps, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
                      lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps, decay=args.decay,
                      weight_decay=args.weight_decay, grad_clip=args.grad_clip, eval_every=args.eval_every,
                      eval_batches=args.eval_batches, checkpoint_every=args.checkpoint_every,
                      keep_last=args.keep_last, seed=args.seed, compile=args.compile)
    start = (read_manifest(out) or {}).get("step", 0) if args.resume else 0
    crash = None
    if args.crash:
        step, stage = args.crash.split(":") if ":" in args.crash else (args.crash, "step")
        crash = (int(step), stage)
    bar = None
    if rank == 0:
        n = model.num_params() if hasattr(model, "num_params") else sum(p.numel() for p in model.parameters())
        print(f"{args.family} {args.preset or 'tiny'}: {n:,} parameters on {device}; run folder {out}"
              + (f"; resuming at step {start}" if start else ""))
        bar = tqdm(total=args.max_steps, initial=start, unit="step", dynamic_ncols=True, disable=args.quiet)

    def on_log(row):
        if "loss" in row:
            bar.update(row["step"] - bar.n)
            bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_s']:,.0f}")
        if "val_loss" in row:
            extra = "".join(f" {k[4:]} {v:.4f}" for k, v in row.items() if k.startswith("val_") and k != "val_loss")
            ppl = f" ppl {math.exp(min(row['val_loss'], 50)):.2f}" if args.family == "gpt2" else ""
            tqdm.write(f"step {row['step']}: val loss {row['val_loss']:.4f}{ppl}{extra}")
        if row.get("nonfinite"):
            tqdm.write(f"step {row['step']}: non-finite loss or gradient, update skipped ({row['skipped']} so far)")

    try:
        result = train(model, objective, train_data, cfg, out, val_data=val_data, tokenizer=tok,
                       resume=args.resume, on_log=on_log if rank == 0 else None, crash_hook=crash)
    finally:
        if bar is not None:
            bar.close()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        how = "stopped by SIGTERM" if result["stopped"] else "done"
        ckpt = out / f"ckpt-{result['saved_at']:08d}"
        print(f"{how} at step {result['step']}; checkpoint {ckpt}; "
              f"metrics {out / 'metrics.jsonl'}; loss curve {out / 'loss.png'}")
    return result


def _add_pretrain(sub):
    p = sub.add_parser("pretrain", help="pretrain GPT-2 (causal LM) or BERT (MLM + NSP) on prepared data",
                       description="Same command on one CPU or under torchrun on many GPUs (DDP).")
    p.add_argument("family", choices=["gpt2", "bert"])
    p.add_argument("--data", required=True, help="directory written by `duolm prepare`")
    p.add_argument("-o", "--out", required=True, help="run folder: checkpoints, metrics.jsonl, tb/, loss.png")
    p.add_argument("--preset", default=None, help="model size preset (default tiny); gpt2, gpt2-medium, bert-base...")
    p.add_argument("--block-size", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument("--n-layer", type=int, default=None, help="override the preset's layers")
    p.add_argument("--n-head", type=int, default=None, help="override the preset's heads")
    p.add_argument("--n-embd", type=int, default=None, help="override the preset's width (bert: n_inner = 4x)")
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch: sequences per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per forward on one process")
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--decay", choices=["cosine", "linear", "constant"], default="cosine")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--keep-last", type=int, default=3, help="checkpoints kept (the newest ones)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in -o")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model for training")
    p.add_argument("--order", choices=["random", "shuffle", "sequential"], default="random", help="gpt2 windows")
    p.add_argument("--masking", choices=["static", "dynamic"], default="dynamic", help="bert")
    p.add_argument("--no-nsp", action="store_true", help="bert: MLM only (RoBERTa)")
    p.add_argument("--whole-word", action="store_true", help="bert: whole-word masking")
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--max-predictions", type=int, default=20, help="bert: masked positions per sequence at most")
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--dupe-factor", type=int, default=1, help="bert static masking: copies with different masks")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--crash", default=None, help=argparse.SUPPRESS)   # tests: "STEP[:step|save|renamed]" -> SIGKILL
    p.set_defaults(func=cmd_pretrain)


# --- prepare ----------------------------------------------------------------------------------

def cmd_prepare(args):
    from pathlib import Path

    from tqdm import tqdm

    from duolm.data import load_tokenizer, prepare

    tok = load_tokenizer(Path(args.tokenizer))
    with tqdm(total=0, unit="B", unit_scale=True, desc="tokenizing", dynamic_ncols=True, disable=args.quiet) as bar:
        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)

        meta = prepare(args.files, tok, args.out, workers=args.workers, val_fraction=args.val_fraction,
                       shard_size=args.shard_size, progress=progress)
    for split, m in meta["splits"].items():
        extra = f", {m['sentences']:,} sentences" if "sentences" in m else ""
        print(f"{split}: {m['tokens']:,} tokens, {m['documents']:,} documents{extra} in {len(m['shards'])} shard(s)")
    print(f"wrote {args.out} ({meta['kind']}, vocab {meta['vocab_size']:,}, {meta['dtype']}) from "
          f"{meta['bytes'] / 1e6:.1f} MB of text")


def _add_prepare(sub):
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


# --- generate / fill-mask -----------------------------------------------------------------------

def cmd_generate(args):
    import torch

    from duolm.checkpoint import load
    from duolm.generation import StopReason, TextStream, beam_search, generate

    model, tok = load(args.dir)
    if not hasattr(model, "hidden") or not hasattr(model, "head"):
        raise ValueError(f"{args.dir} holds a {type(model).__name__}; generate needs a GPT-2 model "
                         f"(for BERT use `duolm fill-mask`)")
    if tok is None or not hasattr(tok, "decode_bytes"):
        raise ValueError(f"{args.dir} has no byte-level BPE tokenizer (vocab.json + merges.txt); generate needs one")
    if args.max_new_tokens < 0 or args.num_beams < 1:
        raise ValueError(f"--max-new-tokens ({args.max_new_tokens}) must be >= 0 and --num-beams ({args.num_beams}) >= 1")
    ids = tok.encode(args.prompt, allowed_special=set(tok.special_tokens))
    if not ids:   # unconditional sampling starts from <|endoftext|>, as GPT-2's samples do
        if tok.eot_id is None:
            raise ValueError("the prompt is empty and the tokenizer has no <|endoftext|> to start from")
        ids = [tok.eot_id]
    window = model.config.block_size
    if args.truncate == "left":
        room = max(1, window - args.max_new_tokens + 1)      # prompt + new tokens fit the window
        if len(ids) > room:
            print(f"duolm: prompt truncated on the left from {len(ids)} to {room} tokens "
                  f"(context window {window}, --max-new-tokens {args.max_new_tokens})", file=sys.stderr)
            ids = ids[-room:]
    elif len(ids) > window:
        raise ValueError(f"the prompt is {len(ids)} tokens but the model's context window is {window}; "
                         f"shorten it or pass --truncate left to keep its last tokens")
    if args.quantize:
        from duolm.quant import quantize
        model = quantize(model, args.quantize)
    elif args.num_beams == 1 and not args.plain_layout:
        # fp32, same numbers: (in, out) copies of the matrices that one-row matmuls read faster
        # on CPU (~1.4x tokens/s for GPT-2 124M at the cost of ~380 MB more memory)
        from duolm.quant import quantize
        model = quantize(model, "decode")
    eot = tok.eot_id
    stop_ids = [[eot]] if eot is not None else []
    stream = TextStream(args.stop or [])
    out = sys.stdout

    def emit(text):
        if text:
            out.write(text)
            if args.stream:
                out.flush()

    emit(args.prompt)
    reason = None
    if args.num_beams > 1:
        new = beam_search(model, [ids], args.max_new_tokens, args.num_beams,
                          length_penalty=args.length_penalty, stop=stop_ids)[0]
        if new and eot is not None and new[-1] == eot:
            new = new[:-1]
        emit(stream.feed(tok.decode_bytes(new)))
    else:
        generator = torch.Generator()
        if args.seed is None:
            generator.seed()                  # fresh entropy: a different sample every run
        else:
            generator.manual_seed(args.seed)
        gen = generate(model, [ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, repetition_penalty=args.repetition_penalty, stop=stop_ids,
                       generator=generator)
        for (t,) in gen:
            if t is None or t == eot:
                continue
            emit(stream.feed(tok.decode_bytes([t])))   # holds back split characters and stop prefixes
            if stream.stopped:
                break
        reason = gen.stop_reasons[0]
    emit(stream.finish())
    out.write("\n")
    out.flush()
    if reason == StopReason.CONTEXT and not stream.stopped:
        print(f"duolm: stopped: the context window of {window} tokens is full "
              f"(prompt {len(ids)} tokens); use a shorter prompt or --truncate left", file=sys.stderr)


def _add_generate(sub):
    p = sub.add_parser("generate", help="continue a prompt with a GPT-2 model",
                       description="Prints the prompt and its continuation; stops at <|endoftext|>, a --stop "
                                   "string, --max-new-tokens or the end of the context window.")
    p.add_argument("dir", help="model directory (duolm, Hugging Face, or a training run)")
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
    p.add_argument("--quantize", choices=["int8", "bf16"], default=None,
                   help="weight-only int8/bf16 matmuls: faster CPU decoding, slightly different numbers")
    p.add_argument("--plain-layout", action="store_true",
                   help="fp32: skip the decode layout (extra (in, out) weight copies, ~380 MB for GPT-2 124M, "
                        "~1.4x faster CPU sampling, same numbers) to save memory")
    p.set_defaults(func=cmd_generate)


def cmd_fill_mask(args):
    from duolm.checkpoint import load
    from duolm.generation import fill_mask

    model, tok = load(args.dir)
    if not hasattr(model, "mlm"):
        raise ValueError(f"{args.dir} holds a {type(model).__name__}; fill-mask needs a BERT model with its "
                         f"masked-LM head (BertForPreTraining, or HF BertForMaskedLM / BertForPreTraining)")
    if tok is None or not hasattr(tok, "mask_id"):
        raise ValueError(f"{args.dir} has no WordPiece tokenizer (vocab.txt); fill-mask needs one")
    enc = tok.encode(args.text)
    if len(enc.ids) > model.config.block_size:
        raise ValueError(f"the text is {len(enc.ids)} tokens but the model's context window is "
                         f"{model.config.block_size}; shorten it")
    if tok.mask_id not in enc.ids:
        raise ValueError('the text has no [MASK]; write [MASK] where a word should go, '
                         'e.g. "The capital of France is [MASK]."')
    results = fill_mask(model, enc.ids, tok.mask_id, top_k=args.top_k, segment_ids=enc.segment_ids)
    piece = {i: s for s, i in tok.vocab.items()}
    best = list(enc.ids)
    for n, fillers in enumerate(results, 1):
        print(f"[MASK] {n}:" if len(results) > 1 else "[MASK]:")
        width = max(len(piece[i]) for i, _ in fillers)
        for i, p in fillers:
            print(f"  {piece[i]:<{width}}  {p:.4f}")
        best[best.index(tok.mask_id)] = fillers[0][0]
    print(tok.decode(best))


def _add_fill_mask(sub):
    p = sub.add_parser("fill-mask", help="fill [MASK] with a BERT model's top predictions")
    p.add_argument("dir", help="model directory with a masked-LM head and vocab.txt")
    p.add_argument("text", help='text with one or more [MASK], e.g. "The capital of France is [MASK]."')
    p.add_argument("--top-k", type=int, default=5, help="fillers shown per mask (default 5)")
    p.set_defaults(func=cmd_fill_mask)


def cmd_demo(args):
    from duolm.demo import run

    run(args.out, text=args.text, gpt2_steps=args.gpt2_steps, bert_steps=args.bert_steps)


def _add_demo(sub):
    p = sub.add_parser("demo", help="train a small GPT-2 and BERT from scratch on the stdlib's docstrings (no download)")
    p.add_argument("--text", default=None, help="your own text file instead (blank lines separate documents)")
    p.add_argument("-o", "--out", default="runs/demo")
    p.add_argument("--gpt2-steps", type=int, default=400)
    p.add_argument("--bert-steps", type=int, default=500)
    p.set_defaults(func=cmd_demo)


# --- end of subcommands ------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duolm", description="GPT-2 and BERT: tokenizers, models, training, generation")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for add in (_add_tokenizer, _add_convert, _add_pretrain, _add_prepare, _add_generate, _add_fill_mask, _add_demo):
        add(sub)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"duolm: error: {e}", file=sys.stderr)
        sys.exit(2)
