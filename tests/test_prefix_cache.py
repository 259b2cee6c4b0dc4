"""The prefix cache (dist_runtime/prefix_cache.py): a request whose prompt begins with the tokens
of an ended session starts from their KV rows, with the tokens it would get without the cache;
whole blocks only; at most all but the last prompt token; least recently used evicted."""

from __future__ import annotations

import numpy as np
import pytest

from dist_runtime.engine import LocalEngine, Request
from dist_runtime.examples import LlamaConfig
from dist_runtime.executor import GraphExecutor
from dist_runtime.prefix_cache import BLOCK, PrefixCache, block_keys
from dist_runtime.sampling import Sampling

from conftest import save_example

pytest.importorskip("numba")
CFG = LlamaConfig(vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_example(tmp_path_factory.mktemp("prefix") / "m.model", CFG, seed=3)


def run(engine: LocalEngine, req: Request) -> tuple[list[int], int, list]:
    """The request's tokens, the prompt tokens it took from the cache, its logprobs; then it ends
    as the server ends it (close_session)."""
    tokens, cached, logprobs = [], 0, []
    for event in engine.stream([req]):
        tokens.append(event.token)
        cached += event.cached
        logprobs.append(event.logprobs)
        if event.done:
            engine.close_session(event.session)
    return tokens, cached, logprobs


def conversation(engine: LocalEngine, turns: int = 4, seed: int = 0) -> list[tuple[list[int], int, list]]:
    """Each turn's prompt: the previous prompt, its answer and new user tokens (as a chat re-sends
    the whole conversation)."""
    rng, prompt, out = np.random.default_rng(seed), [], []
    for turn in range(turns):
        prompt = prompt + [int(t) for t in rng.integers(1, CFG.vocab, 21 + turn)]
        tokens, cached, logprobs = run(engine, Request(f"t{turn}", prompt, 9, Sampling(), logprobs=2))
        out.append((tokens, cached, logprobs))
        prompt = prompt + tokens
    return out


def test_each_turn_starts_from_the_last_one_s_rows_with_the_same_tokens(model):
    cache = PrefixCache(64 * 2**20)
    with_cache = conversation(LocalEngine(GraphExecutor(model), prefix_cache=cache))
    without = conversation(LocalEngine(GraphExecutor(model)))
    assert [t for t, _, _ in with_cache] == [t for t, _, _ in without]
    for (_, _, a), (_, _, b) in zip(with_cache, without):  # the logits' bits: the same log-probabilities
        assert all(x.logprob == y.logprob and x.top == y.top for x, y in zip(a, b))
    assert with_cache[0][1] == 0 and all(c == 0 for _, c, _ in without)
    fed = 0
    for turn, (tokens, cached, _) in enumerate(with_cache[:-1]):
        fed += 21 + turn + len(tokens)  # the next prompt holds this turn's prompt and answer
        assert with_cache[turn + 1][1] == (fed - 1) // BLOCK * BLOCK  # whole blocks of the rows held
    assert cache.hits == 3 and cache.lookups == 4


def test_a_prompt_wholly_cached_still_feeds_its_last_token(model):
    engine = LocalEngine(GraphExecutor(model), prefix_cache=PrefixCache(64 * 2**20))
    prompt = list(range(1, 2 * BLOCK + 1))
    first, _, _ = run(engine, Request("a", prompt, 4))
    again, cached, _ = run(engine, Request("b", prompt, 4))
    assert again == first and cached == BLOCK  # 2 blocks held, but the last token must be fed
    short, cached, _ = run(engine, Request("c", prompt[:BLOCK - 1], 2))
    assert cached == 0  # not a whole block


def test_entries_past_the_budget_are_evicted_least_recently_used(model):
    ex = GraphExecutor(model)
    engine = LocalEngine(ex, prefix_cache=PrefixCache(2**40))
    prompts = [[p] * 40 for p in (1, 2, 3)]
    for i, p in enumerate(prompts):
        run(engine, Request(f"s{i}", p, 2))
    one = engine.prefix_cache.used // 3
    cache = PrefixCache(2 * one)  # room for two
    engine.prefix_cache = cache
    for i, p in enumerate(prompts):
        run(engine, Request(f"r{i}", p, 2))
    assert cache.used <= cache.budget and len(cache._lru) == 2
    assert cache.lookup(prompts[0] + [5])[1] == 0  # the oldest went
    assert cache.lookup(prompts[2] + [5])[1] == 32
    assert PrefixCache(0).lookup(prompts[0])[1] == 0


def test_keys_chain_every_block_before_them():
    a, b = list(range(48)), list(range(48))
    b[3] = 99  # a change in the first block changes every key after it
    ka, kb = block_keys(a), block_keys(b)
    assert len(ka) == 3 and all(x != y for x, y in zip(ka, kb))
    assert block_keys(a[:47]) == ka[:2] and block_keys(a[:15]) == []
