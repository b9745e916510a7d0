"""Automatic prefix caching (serve/prefix.py): the radix tree on a worked example, the scheduler's rows with and without
it (the same greedy ids, log-probabilities within 1e-5), concurrent rows that share and diverge, a prefix reused by a
row of a later batch, eviction under a small budget, and lm-evaluation-harness's local-completions on the PIQA,
ARC-Easy and COPA slices giving the same acc / acc_norm with and without the cache."""
import pytest
import torch

from duolm.serve.prefix import PrefixCache
from duolm.serve.scheduler import Row, Scheduler
from test_mc import N, PREFIX_SETS, runs, served, sets, trained  # noqa: F401
from test_serve import tiny_gpt2

pytestmark = pytest.mark.usefixtures("one_thread")


def _kv(n: int, start: int = 0) -> torch.Tensor:
    """(2 layers x 2, 1 head, n tokens, 1): token i's keys and values all equal start + i."""
    return torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1).expand(4, 1, n, 1).clone()


def test_radix_tree_worked_example():
    c = PrefixCache(budget=1 << 20)
    c.insert([1, 2, 3, 4], _kv(4), None, 0)
    c.insert([1, 2, 7], _kv(3, 10), None, 0)        # splits [1, 2, 3, 4] after [1, 2]; [7] a new leaf
    m, kv, _ = c.match([1, 2, 3, 9], None)
    assert m == 3 and kv[0, 0, :, 0].tolist() == [0, 1, 2]           # the first prompt's keys: 1 2 3
    m, kv, _ = c.match([1, 2, 7, 8], None)
    assert m == 3 and kv[0, 0, :, 0].tolist() == [0, 1, 12]          # [1, 2] stored once, then [7]'s own
    assert c.match([5], None)[0] == 0
    assert c.bytes == (4 + 1) * 4 * 4                                  # 5 tokens x 4 values x 4 bytes
    # log-probabilities: a prefix cached without them does not serve a prompt that needs them
    assert c.match([1, 2, 3], 1)[0] == 0
    infos = [None, (-1.0, [(5, -0.5), (6, -0.7)]), (-2.0, [(2, -0.1), (3, -0.2)])]
    c.insert([1, 2, 3], _kv(3), infos, 2)
    m, _, got = c.match([1, 2, 3, 4], 1)
    assert m == 3 and got == [None, (-1.0, [(5, -0.5)]), (-2.0, [(2, -0.1)])]
    # eviction: least recently used leaves first, down to the budget
    small = PrefixCache(budget=3 * 4 * 4)
    small.insert([1, 2, 3], _kv(3), None, 0)
    small.match([1, 2], None)
    small.insert([4, 5], _kv(2), None, 0)
    assert small.match([1, 2, 3], None)[0] == 0 and small.match([4, 5], None)[0] == 2
    assert small.bytes == 2 * 4 * 4 and small.evicted == 1


def _rows(prompts, **kw):
    return [Row(prompt=p, max_tokens=kw.get("max_tokens", 6), temperature=0.0, logprobs=2, prompt_logprobs=True,
                sink=_Keep()) for p in prompts]


class _Keep:
    def __init__(self):
        self.prompt_lp, self.lp = None, []

    def prompt(self, lp):
        self.prompt_lp = lp

    def token(self, t, info):
        self.lp.append(info)
        return False

    def done(self, reason):
        pass


def _numbers(rows):
    return [([None if i is None else i[0] for i in r.sink.prompt_lp], [i[0] for i in r.sink.lp]) for r in rows]


def _run(sched, batches):
    out = []
    for batch in batches:
        sched.submit(batch)
        while sched.step():
            pass
        out += batch
    return out


def test_shared_and_diverging_prompts_with_and_without_the_cache():
    """Rows that share prefixes and diverge, together in one step and in later batches (a prefix another batch
    cached): the same greedy ids as without the cache and log-probabilities within 1e-5; hits counted."""
    model = tiny_gpt2(vocab_size=97, block_size=128)
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, 97, (40,), generator=g).tolist()
    other = torch.randint(0, 97, (30,), generator=g).tolist()
    prompts = [context + [1, 2], context + [3], context[:20] + [4, 5, 6], other + [7], context + [1, 2, 8]]
    batches = lambda: [_rows(prompts[:3]), _rows(prompts[3:4]), _rows(prompts[4:]), _rows(prompts[:2])]
    cached = Scheduler(model, max_batch=8, prefix_cache_mb=64)
    plain = Scheduler(model, max_batch=8)
    a, b = _run(cached, batches()), _run(plain, batches())
    assert [r.tokens for r in a] == [r.tokens for r in b]
    for (pa, ga), (pb, gb) in zip(_numbers(a), _numbers(b)):
        assert pa[0] is None and pa[1:] == pytest.approx(pb[1:], abs=1e-5) and ga == pytest.approx(gb, abs=1e-5)
    s = cached.stats()
    # a row reuses from the cache the tokens it shares but one (the state before its first new token is computed);
    # rows prefilled in one forward compute a prefix they share once (serve/prefill.py). The first batch's 3 rows
    # miss the cache and are packed in prompt order (context[20] = 59 > 4): context[:20] + [4, 5, 6] whole,
    # context + [1, 2] past its 20 shared tokens, context + [3] past their 40; `other` a miss; context + [1, 2, 8]
    # reuses 42 - 1; then context + [1, 2] and context + [3], whole in the cache, 42 - 1 and 41 - 1
    assert context[20] == 59 and s["prefix_cache_misses"] == 4 and s["prefix_cache_shared_tokens"] == 20 + 40
    assert s["prefix_cache_hits"] == 3 and s["prefix_cache_hit_tokens"] == 41 + 41 + 40
    # scoring rows (one token, lm-evaluation-harness's) reuse it too
    score = Row(prompt=context + [9, 9], max_tokens=1, logprobs=1, prompt_logprobs=True, temperature=0.0, sink=_Keep())
    _run(cached, [[score]])
    assert cached.stats()["prefix_cache_hit_tokens"] > s["prefix_cache_hit_tokens"]


def test_rows_arriving_together_compute_their_shared_context_once():
    """4 scoring rows with one context arriving in one step (lm-evaluation-harness's choices of an item, sent at once):
    the context is computed once, in the one packed forward of the four (serve/prefill.py); positions computed are
    counted (the prompts' less those the cache gave and those shared). The same greedy ids and log-probabilities
    within 1e-5 as without the cache."""
    model = tiny_gpt2(vocab_size=97, block_size=128)
    context = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    endings = [[1, 2], [3], [4, 5, 6], [7, 8]]
    rows = lambda: [Row(prompt=context + e, max_tokens=1, logprobs=1, prompt_logprobs=True, temperature=0.0,
                        sink=_Keep()) for e in endings]
    cached, plain = Scheduler(model, max_batch=4, prefix_cache_mb=64), Scheduler(model, max_batch=4)
    a, b = _run(cached, [rows()]), _run(plain, [rows()])
    assert [r.tokens for r in a] == [r.tokens for r in b]
    for (pa, ga), (pb, gb) in zip(_numbers(a), _numbers(b)):
        assert pa[1:] == pytest.approx(pb[1:], abs=1e-5) and ga == pytest.approx(gb, abs=1e-5)
    s = cached.stats()
    computed = s["prompt_tokens"] - s["prefix_cache_hit_tokens"] - s["prefix_cache_shared_tokens"]
    assert s["prompt_tokens"] == 4 * 30 + 8 and computed == 30 + 8            # the context once, every ending
    assert s["prefix_cache_misses"] == 4 and s["prefix_cache_hits"] == 0


def test_eviction_under_a_small_budget():
    model = tiny_gpt2(vocab_size=97, block_size=128)
    per_token = 2 * model.config.n_layer * model.config.n_embd * 4                 # keys and values in fp32
    sched = Scheduler(model, max_batch=4, prefix_cache_mb=50 * per_token / 2 ** 20)
    prompts = [[k] * 40 for k in range(1, 4)]
    _run(sched, [_rows([p], max_tokens=1) for p in prompts])
    s = sched.stats()
    assert s["prefix_cache_bytes"] <= 50 * per_token and s["prefix_cache_evicted"] >= 2
    _run(sched, [_rows([prompts[0]], max_tokens=1)])        # evicted: a miss
    _run(sched, [_rows([prompts[0]], max_tokens=1)])        # cached again: a hit
    assert sched.stats()["prefix_cache_misses"] == 4 and sched.stats()["prefix_cache_hits"] == 1


def test_lm_eval_scores_the_same_with_and_without_the_prefix_cache(served, runs):
    """lm-evaluation-harness's local-completions against `duolm serve` on the shared PIQA, ARC-Easy and COPA slices
    (test_mc's tiny trained model): the same acc and acc_norm, item for item, with the cache as without, and the
    log-probabilities within 1e-5; the cache was hit. Both runs are test_mc's `runs` (made there beside its own)."""
    cached, plain = served, runs["plain"]
    assert cached["metrics"]["prefix_cache_hits"] > N and "prefix_cache_hits" not in plain["metrics"]
    for task in (f"duolm_mc_{k}" for k in PREFIX_SETS):
        assert len(cached[task]) == N == len(plain[task])
        for a, b in zip(cached[task], plain[task]):
            assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"]), (task, a["doc_id"])
            assert [float(x[0][0]) for x in a["resps"]] == pytest.approx([float(x[0][0]) for x in b["resps"]],
                                                                          abs=1e-5)


@pytest.mark.parametrize("max_tokens", [1, 4])           # scoring rows; rows that join the batch and decode
def test_identical_prompts_and_a_prompt_inside_another_in_one_step(max_tokens):
    """Packed rows of one step where one prompt repeats another whole and one is another's prefix (it computes no
    token of its own): the same greedy ids and log-probabilities within 1e-5 as without the cache, twice (the second
    time from the cache)."""
    model = tiny_gpt2(vocab_size=97, block_size=128)
    context = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [context + [1, 2], context + [1, 2], context, context + [1, 2, 3], context + [5]]
    batches = lambda: [_rows(prompts, max_tokens=max_tokens), _rows(prompts, max_tokens=max_tokens)]
    cached = Scheduler(model, max_batch=8, prefix_cache_mb=64)
    a, b = _run(cached, batches()), _run(Scheduler(model, max_batch=8), batches())
    assert [r.tokens for r in a] == [r.tokens for r in b] and all(len(r.tokens) == max_tokens for r in a)
    for (pa, ga), (pb, gb) in zip(_numbers(a), _numbers(b)):
        assert pa[1:] == pytest.approx(pb[1:], abs=1e-5) and ga == pytest.approx(gb, abs=1e-5)
    assert cached.stats()["prefix_cache_shared_tokens"] >= 20 + 22 + 22     # the context once in the first step
