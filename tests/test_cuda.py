"""duolm on CUDA against duolm on the CPU: logits of both families, greedy decoding with the KV cache, the compiled
static decode step and one-prompt prefill replayed as CUDA graphs, bf16 autocast training against fp32, FSDP2 on one
GPU, a run killed and resumed, a torch.compile'd (fullgraph) model training, and the server answering concurrent
requests (eager and compiled) as it answers them one by one.

Every test here is marked `cuda`: where no CUDA device is present they are deselected and the run says so in its
summary (conftest.py). `pytest -m cuda tests/test_cuda.py` runs them alone on a GPU machine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import signal

import pytest
import torch

from duolm.generation import generate
from duolm.models import GPT2, Bert, BertConfig, GPT2Config
from duolm.objectives import CAUSAL_LM, causal_lm_loss
from duolm.precision import autocast, resolve
from duolm.runs import read_metrics
from duolm.train import TrainConfig, train
from test_static import sharpen
from test_train import Windows, _losses, _pretrain, _weights, gpt2_data  # noqa: F401  (gpt2_data: a fixture)

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """fp32 matmuls in fp32 on the GPU (no TF32), as PyTorch's default is; restored afterwards."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_logits_on_cuda_equal_cpu():
    """GPT-2 124M's shapes and BERT-base's, random weights, fp32: CUDA's logits within 1e-4 of the CPU's, padding
    mask included."""
    torch.manual_seed(0)
    gpt2 = GPT2(GPT2Config.preset("gpt2", block_size=128)).eval()
    bert = Bert(BertConfig.preset("bert-base", block_size=128)).eval()
    x = torch.randint(0, 50257, (2, 100), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[1, 70:] = 0
    with torch.inference_mode():
        want = gpt2(x), bert(x % 30522, attention_mask=mask)
        gpt2.to(CUDA), bert.to(CUDA)
        got = gpt2(x.to(CUDA)), bert((x % 30522).to(CUDA), attention_mask=mask.to(CUDA))
    torch.testing.assert_close(got[0].cpu(), want[0], atol=1e-4, rtol=0)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g.cpu(), w, atol=1e-4, rtol=0)


def test_greedy_decoding_on_cuda_equals_cpu():
    """Three prompts of different lengths (left-padded together), 40 greedy tokens through the KV cache."""
    torch.manual_seed(0)
    model = sharpen(GPT2(GPT2Config(vocab_size=300, block_size=96, n_layer=3, n_head=4, n_embd=64))).eval()
    prompts = [[5, 17, 33], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42]]

    def ids(m):
        gen = generate(m, prompts, 40, temperature=0)
        for _ in gen:
            pass
        return gen.tokens

    want = ids(model)
    got = ids(model.to(CUDA))
    assert got == want and all(len(t) == 40 for t in want)


def test_compiled_decode_step_on_cuda_equals_eager_and_cpu():
    """The static step compiled and replayed as a CUDA graph (generate(compile=True)): batch 1 and 8 (prompts of
    different lengths), 40 greedy tokens equal to the eager path on CUDA and to the CPU; seeded sampling equal to the
    eager path's draws; the steps of both buckets captured. A small sharpened model: with GPT-2 124M's shapes
    sharpened, one row of eight left the eager ids at its 31st token on an H100 (logits of large magnitude: fused and
    unfused fp32 kernels round differently); benchmarks/gpu.py compares 124M's ids at its own initialisation."""
    from duolm.generation.static import decoder_of

    torch.manual_seed(0)
    model = sharpen(GPT2(GPT2Config(vocab_size=1000, block_size=128, n_layer=4, n_head=4, n_embd=128))).eval()
    batches = [[[5, 17, 33, 9]], [list(range(70 * i, 70 * i + 1 + 3 * i)) for i in range(8)]]

    def ids(m, prompts, compile, **kw):
        gen = generate(m, prompts, 40, compile=compile, **kw)
        for _ in gen:
            pass
        return gen.tokens

    want = [ids(model, b, False, temperature=0) for b in batches]
    model.to(CUDA)
    for b, w in zip(batches, want):
        assert ids(model, b, True, temperature=0) == ids(model, b, False, temperature=0) == w
        draws = [ids(model, b, c, temperature=0.9, top_p=0.95, generator=torch.Generator(CUDA).manual_seed(3))
                 for c in (True, False)]
        assert draws[0] == draws[1]
    dec = decoder_of(model)
    assert dec.built == 2 and all(step.graph is not None for step in dec._steps.values())


def test_compiled_prefill_on_cuda_equals_eager():
    """A server's one-prompt prefill compiled and replayed as a CUDA graph (StaticDecoder.prefill, what `duolm serve
    --compile` runs for each joining request): prompts of 1, 9 and 16 tokens (bucket 16) and of 20 (bucket 32) give
    the eager forward's hidden states, keys and values within 1e-4; both buckets captured, each replay's outputs
    those of its own prompt."""
    from duolm.generation.static import StaticDecoder
    from duolm.models import KVCache

    torch.manual_seed(0)
    model = sharpen(GPT2(GPT2Config(vocab_size=1000, block_size=128, n_layer=4, n_head=4, n_embd=128))).to(CUDA)
    dec = StaticDecoder(model)
    with torch.inference_mode():
        for P in (1, 9, 16, 20):
            prompt = list(range(3 * P, 4 * P))
            h, k, v = dec.prefill(prompt)
            cache = KVCache(model.config, 1, max_len=P, device=CUDA)
            want = model.hidden(torch.tensor([prompt], device=CUDA), None, cache)
            torch.testing.assert_close(h, want, rtol=0, atol=1e-4)
            for a, b in zip(k + v, cache.k + cache.v):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert dec.built == 2 and all(p.graph is not None for p in dec._prefills.values())


def test_fsdp2_on_one_gpu_trains_as_the_plain_model():
    """FSDP2 on CUDA (NCCL, a process group of one): each block and the root sharded with bf16 compute and fp32
    reduction (MixedPrecisionPolicy), 30 steps within bf16's tolerance (2%) of the plain model under bf16 autocast."""
    import socket

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from duolm.train.optim import make_optimizer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        curves = {}
        for name in ("plain", "fsdp"):
            torch.manual_seed(0)
            model = GPT2(GPT2Config(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64)).to(CUDA).train()
            if name == "fsdp":
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for block in model.h:
                    fully_shard(block, mp_policy=policy)
                fully_shard(model, mp_policy=policy)
            opt, data, curves[name] = make_optimizer(model, 1e-3), Windows(holes=False), []
            for step in range(30):
                batch = {k: v.to(CUDA) for k, v in data.batch(step, 32).items()}
                with autocast("bf16" if name == "plain" else "fp32", CUDA):
                    loss, _ = causal_lm_loss(model(batch["x"]), batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                curves[name].append(loss.item())
    finally:
        dist.destroy_process_group()
    a, b = torch.tensor(curves["plain"]), torch.tensor(curves["fsdp"])
    assert a[-1] < 0.8 * a[0] and ((a - b).abs() / a).max() < 0.02


def test_bf16_training_on_cuda_tracks_fp32():
    """200 steps of a small GPT-2 through train() in fp32 and in "auto", which on a bf16 GPU is bf16 autocast:
    fp32 weights, the loss curves within 2% of each other at every step."""
    assert resolve("auto", CUDA, training=True) == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    curves = {}
    for precision in ("fp32", "auto"):
        torch.manual_seed(0)
        model = GPT2(GPT2Config(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64)).to(CUDA)
        cfg = TrainConfig(max_steps=200, batch_size=32, lr=1e-3, warmup_steps=10, eval_every=0, precision=precision)
        out = train(model, CAUSAL_LM, Windows(), cfg, tensorboard=False)
        assert out["precision"] == resolve(precision, CUDA, training=True)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        curves[precision] = torch.tensor(_losses(out["rows"]))
    a, b = curves["fp32"], curves["auto"]
    assert len(a) == 200 and a[-1] < 0.5 * a[0]
    assert ((a - b).abs() / a).max() < 0.02 and not torch.equal(a, b)


def test_sigkill_then_resume_on_cuda_is_exact(gpt2_data, tmp_path):
    """`duolm pretrain --device cuda`, killed after step 5 and resumed, equals the run straight through: the same
    losses and the same final weights, bit for bit (bf16 autocast, the GPU's "auto", dropout on)."""
    args = ("--device", "cuda", "--precision", "auto", "--dropout", "0.1")
    _pretrain(gpt2_data, tmp_path / "a", *args)
    b = tmp_path / "b"
    p = _pretrain(gpt2_data, b, *args, "--resume", crash="5:step", check=False)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    _pretrain(gpt2_data, b, *args, "--resume")
    assert json.loads((b / "checkpoint.json").read_text())["precision"] == "bf16"
    assert _losses(read_metrics(b)) == _losses(read_metrics(tmp_path / "a"))
    wa, wb = _weights(tmp_path / "a" / "ckpt-00000012"), _weights(b / "ckpt-00000012")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_compiled_fullgraph_model_trains_like_eager():
    """torch.compile(fullgraph=True) of GPT-2 (no graph breaks) trains under bf16 autocast: 30 steps, its losses
    within 1% of the eager model's at every step."""
    losses = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        model = GPT2(GPT2Config(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64)).to(CUDA).train()
        fwd = torch.compile(model, fullgraph=True) if name == "compiled" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        data = Windows(holes=False)
        losses[name] = []
        for step in range(30):
            batch = {k: v.to(CUDA) for k, v in data.batch(step, 32).items()}
            with autocast("bf16", CUDA):
                logits = fwd(batch["x"])
            loss, _ = causal_lm_loss(logits, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    a, b = torch.tensor(losses["eager"]), torch.tensor(losses["compiled"])
    assert a[-1] < 0.8 * a[0] and ((a - b).abs() / a).max() < 0.01


def test_train_config_compile_on_cuda():
    """TrainConfig(compile=True) on CUDA: the loop's own compiled model, 20 steps, the loss falls."""
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64)).to(CUDA)
    cfg = TrainConfig(max_steps=20, batch_size=32, lr=1e-3, warmup_steps=2, eval_every=0, compile=True)
    curve = _losses(train(model, CAUSAL_LM, Windows(), cfg, tensorboard=False)["rows"])
    assert len(curve) == 20 and curve[-1] < 0.8 * curve[0]


@pytest.mark.parametrize("compile", [False, True])
def test_serve_on_cuda_answers_concurrent_requests_as_sequential_ones(compile):
    """A GPT-2 on the GPU behind the server: 12 greedy completions sent at once (decoded together) equal each sent
    alone, text and tokens; their log-probabilities within 1e-4. With --compile, through the static steps' CUDA
    graphs."""
    pytest.importorskip("fastapi")
    try:
        import httpx2 as httpx               # what starlette's TestClient uses, where installed
    except ImportError:
        httpx = pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from duolm.serve import ServeConfig
    from duolm.serve.app import create_app
    from duolm.tokenizers import ByteLevelBPE

    words = "the king and queen of a small land said that all men must go to sea when winter comes".split()
    tok = ByteLevelBPE.train([" ".join(words * 20)], vocab_size=300)
    torch.manual_seed(0)
    model = sharpen(GPT2(GPT2Config(vocab_size=tok.vocab_size, block_size=128, n_layer=2, n_head=2, n_embd=64)))
    model = model.to(CUDA).eval()
    bodies = [dict(prompt=" ".join(words[i % 7:i % 7 + 1 + i % 5]), max_tokens=8 + i, temperature=0, logprobs=1)
              for i in range(12)]
    config = dataclasses.replace(ServeConfig(max_concurrency=16, compile=compile), device="cuda")
    with TestClient(create_app(model, tok, config)) as c:
        alone = [c.post("/v1/completions", json=b).json()["choices"][0] for b in bodies]

        async def together():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=c.app), base_url="http://t") as ac:
                return [r.json()["choices"][0] for r in
                        await asyncio.gather(*(ac.post("/v1/completions", json=b) for b in bodies))]
        at_once = c.portal.call(together)
    for a, b in zip(alone, at_once):
        assert b["text"] == a["text"] and b["logprobs"]["tokens"] == a["logprobs"]["tokens"]
        assert b["logprobs"]["token_logprobs"] == pytest.approx(a["logprobs"]["token_logprobs"], abs=1e-4)
