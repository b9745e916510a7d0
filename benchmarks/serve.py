"""Serving throughput: aggregate generated tokens/s of `duolm serve` with 1, 4 and 16 concurrent
clients on GPT-2 124M (random weights), against the same requests sent one by one (1 client),
the library alone (generate() per request, no HTTP), and `transformers serve` on the same weights
(plain, and with --continuous-batching), when it runs here.

Every server is a process on 127.0.0.1 with --threads torch threads; the clients are coroutines of this process
(aiohttp, a kept-alive connection each) sending OpenAI /v1/completions requests (a WikiText-2 line as prompt,
--new-tokens tokens, greedy) from a shared list until it is empty. Aggregate tokens/s = completion tokens of all
requests / wall time from the first request to the last answer. Beside each duolm round: the share of the round its
decode loop had work (the rest it waited for requests: HTTP, the clients) and the share of that spent prefilling
joining rows (from the server's GET /metrics). Each configuration runs --rounds times, the servers alternating (duolm,
transformers, transformers CB, duolm, ...), and the best round is kept (on a shared 2-core machine one run can be far
off); the library alone runs once, before them. Before the rounds every server answers, untimed, as many concurrent
requests as each client count once: what a server builds on the first request of a shape (with --compile, the static
steps' graphs of the batch buckets and the prefills' of the prompt lengths, a compilation each) is then built.
The JSON file is written after every configuration, so a run stopped by a time limit keeps what it measured.

    python benchmarks/serve.py [--requests 16] [--new-tokens 64] [--rounds 2] [--threads 2] [--no-transformers]
    python benchmarks/serve.py --device cuda --clients 1,16,64 --max-concurrency 64 --requests 128   # on a GPU

On a GPU (--device cuda) the servers and the library run there, and `transformers serve` is not run.

With --batch-invariant it also serves the model with `duolm serve --batch-invariant` (every sequence decoded
alone: bitwise the same numbers at any concurrency) and compares.

With --scoring N it measures instead what lm-evaluation-harness's loglikelihood requests cost through the
server: N LAMBADA passages (the shared dev file), each one request shaped as lm-eval sends it (the ids of
context + " " + last word, echo, max_tokens 1, logprobs 1, temperature 0), from 4 concurrent clients, against
`duolm eval --task lambada` in this process on the same passages (the numbers checked equal: accuracy and
perplexity from the server's log-probabilities as lm-eval reads them). Both sides run exact fp32 on the fastest
kernels (the server with --precision fp32, `duolm eval`'s default). It also prints the share of the matrix work
the two do: lm-eval asks for every prompt position's log-probability and top-1, so the server runs the output
layer (768 x 50257) on every position, `duolm eval` on the target word's only.

    python benchmarks/serve.py --scoring 64 --threads 2

With --device-ms MS it measures instead what the host costs a server whose device is fast (a GPU's), on any machine:
`duolm serve` on a 1-layer, 8-wide GPT-2 (a 2,000-token BPE trained on WikiText-2) whose blocks' every forward is a
sleep of MS ms, the GIL free meanwhile, as while a GPU runs a step (benchmarks/emulated_server.py), all else as it is;
the server on the last CPU, the clients on the others. It prints the aggregate tokens/s beside the device's bound (a
step of every running row each MS ms): what is missing is HTTP, the scheduler's work and the GIL the two threads
share.

    python benchmarks/serve.py --device-ms 1 --clients 1,16,64 --max-concurrency 64 --requests 128

With --soak N it runs instead the longer version of tests/test_serve_soak.py (whose clients it uses, from
tests/soak.py): N requests from 32 clients to a tiny GPT-2 and to a tiny BERT with a classify head, each served
with --max-concurrency 8, mixed plain and streamed, ~20% left by their client at a random point, ~10%
malformed; it prints the requests, the left ones, the statuses, p50 / p99, the server's RSS before and after
(past a warm-up), whether anything is left running, and how many complete answers differ from the same request
sent alone.

    python benchmarks/serve.py --soak 10000
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import concurrent.futures
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this folder is sys.path[0], and benchmarks/tokenizers.py would shadow the
# `tokenizers` package that transformers imports.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

try:
    import httpx2 as httpx          # what the test extra installs
except ImportError:
    import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import soak  # noqa: E402  (the soak's clients, shared with tests/test_serve_soak.py)

import duolm
from duolm.generation import generate
from duolm.models import GPT2, GPT2Config

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(cmd, url, log_path, env=None, timeout=1800):     # --compile builds every shape before /health is 200
    """Start a server, wait for GET /health, stop it after."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[:3]} exited: {Path(log_path).read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[:3]} did not answer /health in {timeout} s")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield proc
    finally:
        proc.kill()           # a benchmark's server has nothing to drain
        proc.wait()


def run_clients(url, model, prompts, new_tokens, n_clients):
    """-> (aggregate tokens/s, completion tokens): every prompt sent once, by n_clients clients taking the next from a
    shared list, each on a connection of its own kept alive, as coroutines of one asyncio loop (aiohttp, the client
    vLLM's serving benchmark sends with). Threads of httpx clients cost far more: at 64 clients one such process spent
    its whole core and the server waited for it."""
    import aiohttp

    todo = collections.deque(prompts)

    async def client(session):
        done = 0
        while todo:
            body = {"model": model, "prompt": todo.popleft(), "max_tokens": new_tokens, "temperature": 0}
            async with session.post(url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                done += (await r.json())["usage"]["completion_tokens"]
        return done

    async def clients():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n_clients),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            t = time.perf_counter()
            tokens = sum(await asyncio.gather(*(client(session) for _ in range(n_clients))))
            return tokens / (time.perf_counter() - t), tokens

    return asyncio.run(clients())


def by_server(figures: dict) -> dict:
    """{(server, clients): x} -> {server: {str(clients): x}} (the JSON's shape)."""
    out = {}
    for (name, n), x in figures.items():
        out.setdefault(name, {})[str(n)] = x
    return out


def loop_seconds(url) -> tuple[float, float]:
    """A duolm server's decode loop so far (GET /metrics?format=json): (seconds it had work, of which prefilling)."""
    m = httpx.get(url + "/metrics", params={"format": "json"}, timeout=60).raise_for_status().json()
    return m["busy_s"], m["prefill_s"]


def duolm_round(url, model_id, prompts, new_tokens, n_clients) -> tuple[float, float, float]:
    """run_clients against a duolm server -> (aggregate tokens/s, the share of the round its decode loop had work,
    the share of that spent prefilling joining rows)."""
    before, t = loop_seconds(url), time.perf_counter()
    rate, _ = run_clients(url, model_id, prompts, new_tokens, n_clients)
    wall, (busy, prefill) = time.perf_counter() - t, loop_seconds(url)
    busy, prefill = busy - before[0], prefill - before[1]
    return rate, busy / wall, prefill / busy


def shares(busy: float, prefill: float) -> str:
    return f"decode loop busy {busy:.0%} of the round, prefilling {prefill:.0%} of that"


def library_alone(model, tok, prompts, new_tokens):
    """generate() per request, one after another, in this process: the same work without HTTP."""
    t = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for p in prompts:
            gen = generate(model, [tok.encode(p)], new_tokens, temperature=0, stop=[[tok.eot_id]])
            for _ in gen:
                pass
            tokens += len(gen.tokens[0])
    return tokens / (time.perf_counter() - t), tokens


def multinomial_ms(vocab, repeats=50):
    """What one sampled token costs on top of greedy: torch.multinomial over the vocabulary with
    its own generator (a temperature > 0 request pays it per row and step)."""
    probs = torch.rand(1, vocab).softmax(-1)
    g = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    for _ in range(repeats):
        torch.multinomial(probs, 1, generator=g)
    return 1e3 * (time.perf_counter() - t) / repeats


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every server and of the library run")
    ap.add_argument("--no-transformers", action="store_true", help="skip `transformers serve`")
    ap.add_argument("--batch-invariant", action="store_true", help="also `duolm serve --batch-invariant`")
    ap.add_argument("--compile", action="store_true", help="also `duolm serve --compile` (static decode steps; CUDA "
                                                            "graphs on a GPU); it compiles in the untimed warm-up")
    ap.add_argument("--json", help="write the best rates here ({server: {clients: tokens/s}}, the library alone)")
    ap.add_argument("--scoring", type=int, default=0, metavar="N",
                    help="measure lm-eval-shaped scoring of N LAMBADA passages instead")
    ap.add_argument("--soak", type=int, default=0, metavar="N", help="run the serving soak of N requests instead")
    ap.add_argument("--device", default="cpu", help="where the servers and the library run (cuda: a GPU)")
    ap.add_argument("--clients", default="1,4,16", help="the numbers of concurrent clients, comma-separated")
    ap.add_argument("--max-concurrency", type=int, default=16, help="duolm serve's --max-concurrency")
    ap.add_argument("--device-ms", type=float, default=0.0, metavar="MS",
                    help="measure instead what the host costs a server whose device is fast: a tiny GPT-2 whose "
                         "blocks' forward is a sleep of MS ms (benchmarks/emulated_server.py)")
    args = ap.parse_args()
    if args.soak:
        with tempfile.TemporaryDirectory(prefix="duolm-soak-") as tmp:
            return run_soak(args.soak, Path(tmp))
    torch.set_num_threads(args.threads)
    if not (DATA / "gpt2" / "encoder.json").is_file():
        sys.exit(f"{DATA} is absent: the benchmark needs GPT-2's vocabulary and WikiText-2 from it")
    clients = tuple(int(n) for n in args.clients.split(","))
    lines = [ln.strip() for ln in (DATA / "wikitext-2" / "test.txt").read_text(encoding="utf-8").splitlines()
             if 80 < len(ln.strip()) < 200]
    prompts = [" ".join(ln.split()[:20]) for ln in lines[:args.requests]]
    if args.device_ms:
        with tempfile.TemporaryDirectory(prefix="duolm-host-bench-") as tmp:
            return run_host(args, lines, prompts, Path(tmp), clients)
    tok = duolm.ByteLevelBPE.from_files(DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")
    if args.scoring:
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory(prefix="duolm-scoring-bench-") as tmp:
            return run_scoring(args, GPT2(GPT2Config.preset("gpt2")).eval(), tok, Path(tmp))
    torch.manual_seed(0)
    model = GPT2(GPT2Config.preset("gpt2")).eval()

    with tempfile.TemporaryDirectory(prefix="duolm-serve-bench-") as tmp:
        run_all(args, model, tok, prompts, Path(tmp), clients)


def run_all(args, model, tok, prompts, tmp, clients):
    duolm.save(model, tmp / "gpt2-124m", tok)
    threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    servers = [("duolm serve", [sys.executable, "-m", "duolm", "serve", str(tmp / "gpt2-124m"), "--max-concurrency",
                                str(args.max_concurrency), "--max-queue", "64", "--device", args.device], "gpt2-124m",
                threads)]
    if args.batch_invariant:
        servers.append(("duolm serve --batch-invariant", servers[0][1] + ["--batch-invariant"], "gpt2-124m", threads))
    if args.compile:            # "duolm serve" is then the eager one (on a GPU it compiles by default)
        servers.append(("duolm serve --compile", servers[0][1] + ["--compile"], "gpt2-124m", threads))
        servers[0][1].append("--no-compile")
    if not args.no_transformers and args.device == "cpu":
        try:
            import accelerate  # noqa: F401  (transformers serve needs it on CPU)
            import transformers
        except ImportError as e:
            print(f"transformers serve: not run ({e})")
        else:
            duolm.save(model, tmp / "hf", tok, format="hf")
            exe = Path(sys.executable).parent / "transformers"
            # CB's KV cache otherwise takes half of the machine's memory: 256 blocks of 32 tokens hold
            # 16 requests of up to 512 tokens
            cb = ["--continuous-batching", "--cb-block-size", "32", "--cb-num-blocks", "256"]
            for name, extra in (("transformers serve", []), ("transformers serve --continuous-batching", cb)):
                servers.append((name, [str(exe), "serve", str(tmp / "hf"), "--device", "cpu", *extra],
                                str(tmp / "hf"), {"HF_HUB_OFFLINE": "1", **threads}))
            print(f"transformers {transformers.__version__}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}; GPT-2 124M random weights; "
          f"{len(prompts)} requests of ~{sum(len(tok.encode(p)) for p in prompts) // len(prompts)} prompt tokens "
          f"+ {args.new_tokens} new tokens, greedy; best of {args.rounds} rounds")

    best, alone, loop = {}, 0.0, {}

    def save():             # after every configuration: a run stopped by a time limit keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps({"device": args.device, "library_alone": alone,
                                                   "servers": by_server(best), "decode_loop": by_server(loop)},
                                                  indent=1) + "\n")

    model.to(args.device)
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, cmd, model_id, env in servers:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            host = ["--host", "127.0.0.1"] if "transformers" in name else []
            try:
                stack.enter_context(process(cmd + ["--port", str(port)] + host, url, tmp / f"{len(urls)}.log", env))
            except RuntimeError as e:
                print(f"{name}: not run ({str(e)[:300]})")
                continue
            urls[name] = (url, model_id)
        alone = library_alone(model, tok, prompts, args.new_tokens)[0]     # servers idle; once (on a GPU, eager,
        print(f"  library alone: {alone:.1f} tok/s", flush=True)           # it takes a round's time)
        for name, (url, model_id) in urls.items():     # untimed: what a first request of each shape builds
            t = time.perf_counter()
            for n in clients:
                run_clients(url, model_id, prompts[:n], args.new_tokens, n)
            print(f"  {name}: warmed up in {time.perf_counter() - t:.1f} s ({', '.join(map(str, clients))} "
                  "concurrent requests once)", flush=True)
        for _ in range(args.rounds):
            for n in clients:
                for name, (url, model_id) in urls.items():       # A B C A B C ...
                    if name.startswith("duolm"):       # where its time went: decode loop busy or waiting
                        rate, busy, prefill = duolm_round(url, model_id, prompts, args.new_tokens, n)
                        print(f"  {name}, {n} client(s): {rate:.1f} tok/s; {shares(busy, prefill)}", flush=True)
                        if rate > best.get((name, n), 0.0):
                            loop[name, n] = {"busy_share": busy, "prefill_share": prefill}
                    else:
                        rate, _ = run_clients(url, model_id, prompts, args.new_tokens, n)
                        print(f"  {name}, {n} client(s): {rate:.1f} tok/s", flush=True)
                    best[name, n] = max(best.get((name, n), 0.0), rate)
                    save()

    print(f"\nlibrary alone (generate() per request, no HTTP): {alone:.1f} tok/s")
    print(f"{'server':<42} " + " ".join(f"{f'{n} client' + ('s' if n > 1 else ''):>11}" for n in clients)
          + f" {f'{clients[-1]} vs {clients[0]}':>8}")
    for name, _ in urls.items():
        rates = [best[name, n] for n in clients]
        print(f"{name:<42} " + " ".join(f"{r:>7.1f} t/s" for r in rates) + f" {rates[-1] / rates[0]:>7.2f}x")
    d = [best["duolm serve", n] for n in clients]
    print(f"\nduolm serve, {clients[0]} client(s) vs the library alone: {d[0] / alone:.2f}x (HTTP + scheduling "
          "overhead)")
    print("duolm serve, aggregate vs one by one: " + ", ".join(
        f"{n} clients {r / d[0]:.2f}x" for n, r in zip(clients[1:], d[1:])))
    for name in urls:
        if name != "duolm serve":
            print(f"duolm serve vs {name}: " + ", ".join(
                f"{n} client{'s' if n > 1 else ''} {best['duolm serve', n] / best[name, n]:.2f}x" for n in clients))
    print(f"\nsampling (temperature > 0) adds one torch.multinomial over {tok.vocab_size} ids per row and "
          f"step: {multinomial_ms(tok.vocab_size):.2f} ms here")



def run_host(args, lines, prompts, tmp, clients):
    """--device-ms: `duolm serve` on a 1-layer, 8-wide GPT-2 with a 2,000-token BPE (trained on WikiText-2 here), its
    blocks' forward a sleep of args.device_ms (benchmarks/emulated_server.py): aggregate tokens/s against the
    device's bound, a step of n rows each device_ms (what a server with no host cost would reach). The server runs on
    the last CPU, the clients on the others (where there are two or more)."""
    tok = duolm.ByteLevelBPE.train(lines[:2000], 2000)
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=tok.vocab_size, block_size=256, n_layer=1, n_head=1, n_embd=8)).eval()
    duolm.save(model, tmp / "tiny", tok)
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["taskset", "-c", str(cpus[-1])] if len(cpus) > 1 and shutil.which("taskset") else []
    if pin:
        os.sched_setaffinity(0, cpus[:-1])
    url = f"http://127.0.0.1:{free_port()}"
    cmd = pin + [sys.executable, str(Path(__file__).with_name("emulated_server.py")), str(args.device_ms), "serve",
                 str(tmp / "tiny"), "--port", url.rsplit(":", 1)[1], "--max-concurrency", str(args.max_concurrency),
                 "--max-queue", str(max(64, len(prompts)))]
    print(f"duolm serve, a device of {args.device_ms:g} ms a forward (emulated); {len(prompts)} requests of "
          f"~{sum(len(tok.encode(p)) for p in prompts) // len(prompts)} prompt tokens + {args.new_tokens} new tokens, "
          f"greedy; server {'on CPU ' + str(cpus[-1]) if pin else 'unpinned'}; best of {args.rounds} rounds")
    best = {}
    with process(cmd, url, tmp / "server.log", {"OMP_NUM_THREADS": "1"}):
        for n in clients:                  # untimed: the first requests of each batch size
            run_clients(url, "tiny", prompts[:n], args.new_tokens, n)
        for _ in range(args.rounds):
            for n in clients:
                rate, busy, prefill = duolm_round(url, "tiny", prompts, args.new_tokens, n)
                print(f"  {n} client(s): {rate:.0f} tok/s; {shares(busy, prefill)}", flush=True)
                best[n] = max(best.get(n, 0.0), rate)
    bound = {n: min(n, args.max_concurrency) * 1e3 / args.device_ms for n in clients}
    print("\nclients  tokens/s  the device's bound  share")
    for n in clients:
        print(f"{n:>7}  {best[n]:>8.0f}  {bound[n]:>18.0f}  {best[n] / bound[n]:>5.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device_ms": args.device_ms, "tokens_per_s": best,
                                               "bound": bound}, indent=1) + "\n")


def lm_eval_scores(url, model_id, seqs, n_clients=4):
    """-> (seconds, [(sum of the continuation's log p, greedy)] per (context ids, continuation ids)): one request
    per passage as lm-evaluation-harness's local-completions sends it, read as it reads the answer."""
    def score(seq):
        ctx, cont = seq
        body = {"model": model_id, "prompt": [ctx + cont], "max_tokens": 1, "echo": True, "logprobs": 1,
                "temperature": 0, "seed": 1234}
        with httpx.Client(timeout=600) as c:
            lp = c.post(url + "/v1/completions", json=body).raise_for_status().json()["choices"][0]["logprobs"]
        tokens, tops = lp["token_logprobs"][len(ctx):-1], lp["top_logprobs"][len(ctx):-1]
        return sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops))

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n_clients) as pool:
        out = list(pool.map(score, seqs))
    return time.perf_counter() - t, out


def same_work(model, seqs, batch_size=8) -> float:
    """-> seconds for what the server computes for these requests, in this process and batched as duolm eval
    batches: every position's log p and its most likely token (lm-eval's echo + logprobs 1)."""
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(seqs), batch_size):
            ids = [a + b for a, b in seqs[i:i + batch_size]]
            idx = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)
            for j, x in enumerate(ids):
                idx[j, :len(x)] = torch.tensor(x)
            h = model.hidden(idx)
            targets = torch.tensor([t for x in ids for t in x[1:]])
            lp = model.head(torch.cat([h[j, :len(x) - 1] for j, x in enumerate(ids)])).float().log_softmax(-1)
            lp.gather(1, targets[:, None]), lp.topk(1)
    return time.perf_counter() - t


def run_scoring(args, model, tok, tmp):
    """lm-eval-shaped scoring requests through `duolm serve` against duolm eval in this process."""
    import math

    from duolm.evaluation import evaluate_lm
    from duolm.evaluation.readers import lambada_examples
    from duolm.precision import quantize

    examples = lambada_examples(DATA / "lambada" / "lambada_development_plain_text.txt")[:args.scoring]
    seqs = [(tok.encode_ordinary(ex.context), tok.encode_ordinary(ex.target)) for ex in examples]
    duolm.save(model, tmp / "gpt2-124m", tok)
    fast = quantize(copy.deepcopy(model), "fp32")         # `duolm eval`'s default, and the server's --precision fp32
    fast = quantize(copy.deepcopy(model), "fp32")         # `duolm eval`'s default, and the server's --precision fp32
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "duolm", "serve", str(tmp / "gpt2-124m"), "--port", url.rsplit(":", 1)[1],
           "--precision", "fp32"]
    threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    print(f"torch {torch.__version__}, {args.threads} threads; GPT-2 124M random weights; {len(seqs)} LAMBADA "
          f"passages of ~{sum(len(a) + len(b) for a, b in seqs) // len(seqs)} tokens; best of {args.rounds} rounds")
    best_eval = best_serve = best_same = float("inf")
    with process(cmd, url, tmp / "serve.log", threads):
        lm_eval_scores(url, "gpt2-124m", seqs[:4])                        # warm up
        for _ in range(args.rounds):
            t = time.perf_counter()
            ref = evaluate_lm(fast, tok, "lambada", examples)             # duolm eval's batch size, 8
            best_eval = min(best_eval, time.perf_counter() - t)
            best_same = min(best_same, same_work(fast, seqs))
            seconds, scores = lm_eval_scores(url, "gpt2-124m", seqs)
            best_serve = min(best_serve, seconds)
            print(f"  duolm eval {len(seqs) / best_eval:.2f} passages/s, the server's work in-process "
                  f"{len(seqs) / best_same:.2f}, duolm serve {len(seqs) / seconds:.2f}", flush=True)
    acc = 100 * sum(greedy for _, greedy in scores) / len(scores)
    ppl = math.exp(-sum(s for s, _ in scores) / len(scores))
    print(f"same numbers: accuracy {acc:.2f} vs {ref['acc_last_word']:.2f}, perplexity {ppl:.6g} vs {ref['ppl']:.6g}")
    print(f"duolm eval in-process: {len(seqs) / best_eval:.2f} passages/s; duolm serve, 4 clients: "
          f"{len(seqs) / best_serve:.2f} passages/s; ratio {best_eval / best_serve:.2f}x (target >= 0.7x)")
    print(f"the server's work (every position's log p and top-1, batched by 8) in-process: {len(seqs) / best_same:.2f} "
          f"passages/s ({best_eval / best_same:.2f}x duolm eval); duolm serve / that: {best_same / best_serve:.2f}x")
    body = sum(p.numel() for n, p in model.named_parameters() if n.startswith("h."))      # the blocks' matmuls
    head = model.config.n_embd * model.config.vocab_size
    tokens = sum(len(a) + len(b) for a, b in seqs)
    eval_flops = body * tokens + head * sum(len(b) for _, b in seqs)
    serve_flops = body * tokens + head * tokens
    print(f"matrix work: duolm eval runs the output layer on the target word's positions only, the server on every "
          f"position (lm-eval asks each one's log p and top-1): {eval_flops / serve_flops:.2f}x the server's "
          f"multiply-adds, the ratio at equal speed")


def run_soak(n, tmp, clients=32, warmup=500):
    """The soak of tests/test_serve_soak.py with n requests, on each tiny model in turn; prints its figures."""
    if not (DATA / "bert-vocab").is_dir():
        sys.exit(f"{DATA} is absent: the soak needs GPT-2's and BERT's vocabularies from it")
    args = ["--max-concurrency", "8", "--max-queue", "24", "--max-body-bytes", str(soak.MAX_BODY)]
    print(f"soak: {n} requests (after {warmup} to warm up) from {clients} clients; server {' '.join(args)}")
    for model_dir, goods in zip(soak.tiny_models(DATA, tmp), (soak.gpt2_goods(), soak.bert_goods())):
        url = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "duolm", "serve", str(model_dir), "--port", url.rsplit(":", 1)[1], *args]
        with process(cmd, url, tmp / f"{model_dir.name}.log", {"OMP_NUM_THREADS": "1"}) as proc:
            soak.soak(url, goods, warmup, clients, seed=1)
            before = soak.settled(url)
            rss_before = soak.rss_kb(proc.pid)
            t = time.perf_counter()
            outcomes = soak.soak(url, goods, n, clients, seed=2, time_limit=60 + n)
            wall = time.perf_counter() - t
            m = soak.settled(url)
            rss_after = soak.rss_kb(proc.pid)
            health = httpx.get(url + "/health", timeout=10).json()["status"]
            reference = soak.alone(url, goods)
        complete = [o for o in outcomes if o.answer is not None]
        differ = sum(not soak.same(o.answer, reference[o.job.key]) for o in complete)
        print(f"{model_dir.name}: {soak.figures(outcomes).line()}; {wall:.1f} s")
        print(f"  RSS {rss_before / 1024:.1f} -> {rss_after / 1024:.1f} MiB ({100 * (rss_after / rss_before - 1):+.2f}%); "
              f"/health {health}; in flight {m['in_flight']}, running {m['running']}, waiting {m['queue_depth']}"
              + (f"; rows ended in the soak {ended(before, m)}" if "finish_reasons" in m else "")
              + f"; {len(complete)} complete answers, {differ} differ from the request alone")



def ended(before: dict, after: dict) -> dict:
    """GPT-2's decode rows ended between two /metrics, by finish reason."""
    return {k: n - before["finish_reasons"].get(k, 0) for k, n in after["finish_reasons"].items()}


if __name__ == "__main__":
    main()
