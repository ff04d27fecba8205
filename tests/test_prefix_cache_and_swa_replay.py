"""The engine's prefix cache and SWA bounded replay on real checkpoints (tiny: sliding, full, sliding, full; W = 32).

- Replay off: a request that hits the cache computes exactly what a cold run computes (tokens and logits).
- Replay on: after an adopted hit at H, prefill computes the tail plus one window; a hit of W tokens or
  fewer is not adopted; the hit stays below the prompt length; the counters add up.
- Replay on differs from a cold run by design: the divergence is measured and printed, not asserted.
- Sliding-window KV is held for cached prefixes only with replay off; cached full-attention blocks are never
  rewritten by a replay; LRU eviction under a small pool still gives cold-run tokens; EOS ends generation.
- A Llama checkpoint (no q/k norms, tied embeddings, llama3 RoPE scaling) and a Mistral one (every layer
  sliding) match Hugging Face transformers.

Run with `-s` to see the measured replay divergence.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from wcache.engine import Engine, EngineConfig, Generation, ModelConfig
from wcache.engine.block_manager import KVCacheFullError, chain_hashes
from wcache.engine.threads import MACS_PER_THREAD
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import Preset, make_tensors, write_tensors

WINDOW = 32
BLOCK = 16
EOS = 257
NEW_TOKENS = 16
# Replay off must reproduce a cold run. The tail is computed with fewer matmul rows than the cold prefill;
# on this CPU the logits come out bit-identical, a BLAS that blocks by row count may round differently.
SAME_LOGITS_ATOL = 1e-5


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """These matrices are tiny: with several threads, synchronisation costs more than the arithmetic (10x on a
    busy 2-core machine). The setting is restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_LOADED: dict[Path, tuple[ModelConfig, Mapping[str, torch.Tensor]]] = {}


def make_engine(checkpoint: Path, replay: bool, num_blocks: int = 256) -> Engine:
    """A fresh engine (empty cache); the weights are loaded from disk through the plan once per checkpoint."""
    config = EngineConfig(block_size=BLOCK, num_blocks=num_blocks, swa_bounded_replay=replay)
    if checkpoint not in _LOADED:
        loaded = Engine.from_disk(checkpoint, plan=PlanSpec(), engine_config=config)
        _LOADED[checkpoint] = (loaded.model_config, loaded.model.weights)
    model_config, weights = _LOADED[checkpoint]
    return Engine(model_config, weights, config)


def capture_logits(engine: Engine) -> list[torch.Tensor]:
    """Record the last-row logits of every step `generate` takes (the ones its greedy tokens come from)."""
    recorded: list[torch.Tensor] = []
    original: Callable[[torch.Tensor], torch.Tensor] = engine.model.logits

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = original(hidden)
        recorded.append(out[-1].clone())
        return out

    engine.model.logits = logits  # type: ignore[method-assign]
    return recorded


def cold_run(checkpoint: Path, prompt: list[int], replay: bool = True,
             new_tokens: int = NEW_TOKENS) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step logits of `prompt` in a fresh engine (nothing cached)."""
    engine = make_engine(checkpoint, replay)
    recorded = capture_logits(engine)
    generation = engine.generate(prompt, new_tokens)
    assert generation.hit_tokens == 0 and engine.counters.prefill_tokens == len(prompt)
    return generation.token_ids, recorded


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if k != "swa_cached_bytes" and after[k] != before[k]}


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=False))


FIRST = _prompt(1, 100)
# Shares 90 tokens with FIRST: the lookup finds 5 blocks (80 tokens).
SECOND = [*FIRST[:90], *_prompt(2, 20)]


# -- (a) replay off: a hit is exactly a cold run -----------------------------------------------------------


def test_replay_off_hit_is_identical_to_a_cold_run(tiny_template: Path) -> None:
    engine = make_engine(tiny_template, replay=False)
    engine.generate(FIRST, NEW_TOKENS)
    recorded = capture_logits(engine)
    hit = engine.generate(SECOND, NEW_TOKENS)
    assert (hit.hit_tokens, hit.adopted, hit.replayed_tokens, hit.prefill_tokens) == (80, True, 0, 30)

    cold_tokens, cold_logits = cold_run(tiny_template, SECOND, replay=False)
    assert hit.token_ids == cold_tokens
    assert len(recorded) == len(cold_logits) == NEW_TOKENS
    torch.testing.assert_close(recorded[0], cold_logits[0], atol=SAME_LOGITS_ATOL, rtol=0)
    assert max_diff(recorded, cold_logits) <= SAME_LOGITS_ATOL
    # The cold engine's prefill_logits agree with its generate path, so either is a valid baseline.
    reference = make_engine(tiny_template, replay=False).prefill_logits(SECOND)[-1]
    torch.testing.assert_close(recorded[0], reference, atol=SAME_LOGITS_ATOL, rtol=0)

    assert engine.counters.snapshot() == {
        "requests": 2, "prefix_queries": 210, "prefix_hits": 80, "lookup_hits": 80, "adopted_hits": 1,
        "rejected_hits": 0, "replayed_tokens": 0, "prefill_tokens": 100 + 30, "prefill_tokens_saved": 80,
        "generation_tokens": 32, "swa_cached_bytes": engine.counters.swa_cached_bytes,
    }


def test_replay_off_hit_on_generated_tokens_is_identical_to_a_cold_run(tiny_template: Path) -> None:
    # A follow-up turn: the previous prompt, its answer, and a new question. The hit covers blocks written
    # while decoding, whose sliding-window KV was stored one token at a time.
    engine = make_engine(tiny_template, replay=False)
    answer = engine.generate(FIRST, NEW_TOKENS).token_ids
    follow_up = [*FIRST, *answer, *_prompt(3, 10)]
    recorded = capture_logits(engine)
    hit = engine.generate(follow_up, NEW_TOKENS)
    # FIRST plus 15 decoded tokens had KV stored: 115 tokens, 7 full blocks.
    assert hit.hit_tokens == 112 and hit.adopted and hit.prefill_tokens == len(follow_up) - 112
    cold_tokens, cold_logits = cold_run(tiny_template, follow_up, replay=False)
    assert hit.token_ids == cold_tokens
    assert max_diff(recorded, cold_logits) <= SAME_LOGITS_ATOL


def test_replay_off_adopts_short_hits(tiny_template: Path) -> None:
    engine = make_engine(tiny_template, replay=False)
    engine.generate(FIRST, 4)
    prompt = [*FIRST[:40], *_prompt(4, 30)]
    hit = engine.generate(prompt, NEW_TOKENS)
    assert (hit.hit_tokens, hit.adopted, hit.prefill_tokens) == (WINDOW, True, len(prompt) - WINDOW)
    assert engine.counters.rejected_hits == 0
    assert hit.token_ids == cold_run(tiny_template, prompt, replay=False)[0]


# -- (b) replay on: what prefill computes, and the counters -------------------------------------------------


def _after_first(checkpoint: Path, prompt: list[int]) -> tuple[Generation, dict[str, int]]:
    """A replaying engine that has served FIRST, then `prompt`: what it generated and how the counters moved."""
    engine = make_engine(checkpoint, replay=True)
    engine.generate(FIRST, NEW_TOKENS)
    before = engine.counters.snapshot()
    hit = engine.generate(prompt, NEW_TOKENS)
    return hit, delta(before, engine.counters.snapshot())


@pytest.mark.parametrize(("shared", "expected_hit"), [(90, 80), (49, 48), (70, 64)])
def test_replay_prefills_tail_plus_one_window(tiny_template: Path, shared: int, expected_hit: int) -> None:
    prompt = [*FIRST[:shared], *_prompt(5, 25)]
    hit, counted = _after_first(tiny_template, prompt)
    tail = len(prompt) - expected_hit
    assert hit.hit_tokens == expected_hit and hit.adopted
    assert hit.replayed_tokens == WINDOW
    assert hit.prefill_tokens == tail + WINDOW
    assert counted == {
        "requests": 1,
        "prefix_queries": len(prompt),
        "prefix_hits": expected_hit,  # vLLM's accounting: the replayed window is part of the hit
        "lookup_hits": expected_hit,
        "adopted_hits": 1,
        "replayed_tokens": WINDOW,
        "prefill_tokens": tail + WINDOW,
        "prefill_tokens_saved": expected_hit - WINDOW,
        "generation_tokens": len(hit.token_ids),
    }


@pytest.mark.parametrize(("shared", "expected_hit"), [(40, 32), (20, 16)])
def test_replay_rejects_hits_of_one_window_or_less(tiny_template: Path, shared: int, expected_hit: int) -> None:
    prompt = [*FIRST[:shared], *_prompt(6, 50)]
    hit, counted = _after_first(tiny_template, prompt)
    assert hit.hit_tokens == expected_hit  # what the lookup found
    assert not hit.adopted and hit.replayed_tokens == 0
    assert hit.prefill_tokens == len(prompt)
    assert counted == {
        "requests": 1, "prefix_queries": len(prompt), "lookup_hits": expected_hit, "rejected_hits": 1,
        "prefill_tokens": len(prompt), "generation_tokens": len(hit.token_ids),
    }
    # Nothing was reused, so the request is an exact cold run.
    assert hit.token_ids == cold_run(tiny_template, prompt)[0]


@pytest.mark.parametrize(
    ("length", "replay", "expected_hit"),
    [(81, True, 80), (64, True, 48), (81, False, 80), (64, False, 48), (16, False, 0), (17, False, 16)],
)
def test_hit_is_capped_below_the_prompt_length(tiny_template: Path, length: int, replay: bool,
                                               expected_hit: int) -> None:
    # The same prompt twice: every block is cached, yet the last token is always computed for its logits.
    engine = make_engine(tiny_template, replay=replay)
    prompt = _prompt(7, length)
    first = engine.generate(prompt, NEW_TOKENS)
    again = engine.generate(prompt, NEW_TOKENS)
    assert again.hit_tokens == expected_hit
    window = WINDOW if replay else 0
    adopted = expected_hit > window
    assert again.adopted == adopted
    assert again.prefill_tokens == (length - expected_hit + window if adopted else length)
    assert again.prefill_tokens >= 1
    if not replay:
        assert again.token_ids == first.token_ids


def test_prefix_counters_over_a_sequence(tiny_template: Path) -> None:
    engine = make_engine(tiny_template, replay=True)
    prompts = [FIRST, SECOND, [*FIRST[:40], 1, 2, 3], _prompt(8, 50), FIRST]
    generations = [engine.generate(p, 8) for p in prompts]
    assert [g.hit_tokens for g in generations] == [0, 80, 32, 0, 96]
    assert [g.adopted for g in generations] == [False, True, False, False, True]
    c = engine.counters
    assert c.requests == 5
    assert c.prefix_queries == sum(map(len, prompts))
    assert c.lookup_hits == 80 + 32 + 96
    assert c.prefix_hits == 80 + 96
    assert (c.adopted_hits, c.rejected_hits) == (2, 1)
    assert c.replayed_tokens == 2 * WINDOW
    assert c.prefill_tokens == sum(g.prefill_tokens for g in generations)
    assert c.prefill_tokens + c.prefill_tokens_saved == c.prefix_queries
    assert c.prefill_tokens_saved == (80 - WINDOW) + (96 - WINDOW)
    assert c.generation_tokens == sum(len(g.token_ids) for g in generations)


# -- (c) replay on vs cold: measured, not asserted -----------------------------------------------------------


def _divergence(checkpoint: Path, replay: bool, prompts: list[list[int]]) -> list[dict[str, Any]]:
    rows = []
    for i, prompt in enumerate(prompts):
        engine = make_engine(checkpoint, replay)
        engine.generate([*prompt[:90], *_prompt(100 + i, 10)], NEW_TOKENS)  # caches the shared prefix
        recorded = capture_logits(engine)
        hit = engine.generate(prompt, NEW_TOKENS)
        cold_tokens, cold_logits = cold_run(checkpoint, prompt, replay)
        differing = sum(a != b for a, b in zip(hit.token_ids, cold_tokens, strict=True))
        first = next((k for k, (a, b) in enumerate(zip(hit.token_ids, cold_tokens, strict=True)) if a != b), None)
        agreeing = (first if first is not None else NEW_TOKENS) or 1
        rows.append({
            "prompt": i, "hit": hit.hit_tokens, "prefill": hit.prefill_tokens, "differing_tokens": differing,
            "first_divergence": first,
            "first_logit_max_diff": float((recorded[0] - cold_logits[0]).abs().max()),
            # Beyond the first divergence the two runs decode different tokens, so only compare up to it.
            "max_logit_diff_while_agreeing": max_diff(recorded[:agreeing], cold_logits[:agreeing]),
        })
    return rows


def test_replay_divergence_is_measured(tiny_template: Path) -> None:
    prompts = [SECOND, *([*_prompt(20 + i, 90), *_prompt(30 + i, 20)] for i in range(3))]
    on = _divergence(tiny_template, True, prompts)
    off = _divergence(tiny_template, False, prompts)
    print("\nSWA bounded replay vs cold runs (tiny, W=32, 80-token hits, 110-token prompts, 16 greedy tokens):")
    for label, rows in (("replay on ", on), ("replay off", off)):
        for row in rows:
            print(f"  {label} prompt {row['prompt']}: hit {row['hit']}, prefill {row['prefill']}, "
                  f"{row['differing_tokens']}/{NEW_TOKENS} tokens differ (first at {row['first_divergence']}), "
                  f"max |Δlogit| first step {row['first_logit_max_diff']:.3g}, "
                  f"while agreeing {row['max_logit_diff_while_agreeing']:.3g}")
    assert all(row["hit"] == 80 and row["prefill"] == 30 + WINDOW for row in on)
    assert all(row["hit"] == 80 and row["prefill"] == 30 for row in off)
    # By design replay on may differ (its replayed tokens see a clipped window); replay off may not.
    assert [row["differing_tokens"] for row in off] == [0, 0, 0, 0]
    assert all(row["max_logit_diff_while_agreeing"] <= SAME_LOGITS_ATOL for row in off)


# -- (d) sliding-window KV held for cached prefixes ----------------------------------------------------------


def test_sliding_window_bytes_only_without_replay(tiny_template: Path) -> None:
    off, on = make_engine(tiny_template, replay=False), make_engine(tiny_template, replay=True)
    for engine in (off, on):
        engine.generate(FIRST, NEW_TOKENS)
        engine.generate(SECOND, NEW_TOKENS)
    sliding = off.model_config.sliding_layers
    assert sliding == (0, 2)
    # Per block: k and v for 2 sliding layers, 16 positions, 2 KV heads of 16 floats.
    per_block = 2 * 2 * BLOCK * 2 * 16 * 4
    assert off.kv.bytes_per_block(sliding) == per_block
    assert off.blocks.num_cached > 0
    assert off.counters.swa_cached_bytes == per_block * off.blocks.num_cached > 0
    assert on.counters.swa_cached_bytes == 0
    # With replay the sliding layers have no paged pool at all; the full layers keep theirs.
    assert sorted(on.kv.k) == list(on.model_config.full_layers) == [1, 3]
    assert sorted(off.kv.k) == [0, 1, 2, 3]
    assert on.blocks.num_cached == off.blocks.num_cached


# -- (e) cached blocks are never rewritten ----------------------------------------------------------------


@pytest.mark.parametrize("replay", [True, False])
def test_cached_blocks_stay_as_first_written(tiny_template: Path, replay: bool) -> None:
    engine = make_engine(tiny_template, replay=replay)
    engine.generate(FIRST, NEW_TOKENS)
    hit_blocks = engine.blocks.match(chain_hashes(SECOND, BLOCK)[:5])
    assert len(hit_blocks) == 5
    cached_before = [b for b in range(len(engine.blocks.blocks)) if engine.blocks.is_cached(b)]
    snapshot = {layer: (engine.kv.k[layer].clone(), engine.kv.v[layer].clone()) for layer in engine.kv.k}
    hit = engine.generate(SECOND, NEW_TOKENS)
    assert hit.adopted and hit.replayed_tokens == (WINDOW if replay else 0)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        # Bit for bit: the pool is not zeroed, and a block never written may hold any bytes, NaNs included.
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    for layer, (k, v) in snapshot.items():
        assert same(engine.kv.k[layer][hit_blocks], k[hit_blocks]), f"layer {layer} keys rewritten"
        assert same(engine.kv.v[layer][hit_blocks], v[hit_blocks]), f"layer {layer} values rewritten"
        changed = {
            b for b in range(k.shape[0])
            if not (same(engine.kv.k[layer][b], k[b]) and same(engine.kv.v[layer][b], v[b]))
        }
        assert changed, "the new request's own blocks should have been written"
        assert changed.isdisjoint(cached_before), f"layer {layer}: cached blocks {changed & set(cached_before)}"


# -- (f) LRU eviction ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("replay", [False, True])
def test_eviction_under_a_small_pool_keeps_outputs_correct(tiny_template: Path, replay: bool) -> None:
    shared = _prompt(40, 64)
    prompts = [
        [*shared, *_prompt(41, 30)],
        [*shared, *_prompt(42, 30)],  # hits the shared 64 tokens
        _prompt(43, 120),  # 135 tokens with decoding: 9 of the 10 blocks, so most of the cache goes
        [*shared, *_prompt(44, 30)],  # what is left of the shared prefix, if anything
        _prompt(43, 120),
        [*shared, *_prompt(41, 30)],
    ]
    small = make_engine(tiny_template, replay, num_blocks=10)
    large = make_engine(tiny_template, replay)
    small_hits, large_hits = [], []
    for prompt in prompts:
        got = small.generate(prompt, NEW_TOKENS)
        small_hits.append(got.hit_tokens)
        large_hits.append(large.generate(prompt, NEW_TOKENS).hit_tokens)
        assert small.blocks.num_cached <= 10 and small.blocks.num_free == 10
        assert got.hit_tokens % BLOCK == 0
        if not replay or not got.adopted:
            # Replay off (any hit, whatever survived eviction) or nothing adopted: exactly a cold run.
            assert got.token_ids == cold_run(tiny_template, prompt, replay)[0]
    assert large_hits == [0, 64, 0, 64, 112, 80]
    assert sum(small_hits) < sum(large_hits)  # eviction did happen
    assert small_hits[:3] == [0, 64, 0]


def test_eviction_takes_a_prefix_tail_first(tiny_template: Path) -> None:
    # As vLLM frees a finished request's blocks in reverse order: the LRU then evicts a cached prefix from its
    # end, so what survives is still a prefix that can hit. Evicting from the head would strand the rest of the
    # chain: cached, taking pool space, and unreachable (a chained hash needs every block before it).
    engine = make_engine(tiny_template, replay=False, num_blocks=10)
    long_prompt = _prompt(45, 120)
    engine.generate(long_prompt, NEW_TOKENS)  # 135 tokens: 9 blocks, the first 8 cached
    # 109 tokens: 7 blocks, i.e. the never-used one and 6 of the first request's (its partial last one and 5
    # cached ones), leaving 3 of its cached blocks.
    engine.generate(_prompt(46, 94), NEW_TOKENS)
    again = engine.generate(long_prompt, NEW_TOKENS)
    assert again.hit_tokens == 3 * BLOCK, "the surviving blocks of the first request are not its prefix"


def test_a_request_larger_than_the_pool_fails_cleanly(tiny_template: Path) -> None:
    engine = make_engine(tiny_template, replay=True, num_blocks=4)
    engine.generate(_prompt(50, 40), 4)
    with pytest.raises(KVCacheFullError, match="num_blocks"):
        engine.generate(_prompt(51, 60), 8)  # 67 tokens need 5 blocks
    # Its blocks went back; the engine still serves requests that fit.
    assert engine.blocks.num_free == 4
    prompt = _prompt(52, 40)
    assert engine.generate(prompt, 8).token_ids == cold_run(tiny_template, prompt, new_tokens=8)[0]


# -- (g) EOS --------------------------------------------------------------------------------------------------


def test_eos_stops_generation(tiny_template: Path) -> None:
    base = make_engine(tiny_template, replay=True)
    assert base.model_config.eos_token_ids == (EOS,)
    prompt = _prompt(60, 50)
    free_run = base.generate(prompt, 24).token_ids
    assert len(free_run) == 24 and EOS not in free_run
    # Make a token the greedy run produces at step k (and not before) the end-of-sequence token.
    k = next(i for i in range(2, 24) if free_run[i] not in free_run[:i])
    config = dataclasses.replace(base.model_config, eos_token_ids=(free_run[k], EOS))
    engine = Engine(config, base.model.weights, base.config)
    stopped = engine.generate(prompt, 24)
    assert stopped.token_ids == free_run[: k + 1]
    assert engine.counters.generation_tokens == k + 1
    # The request's blocks were released and registered as usual: the same prompt hits afterwards.
    assert engine.blocks.num_free == engine.config.num_blocks
    assert engine.generate(prompt, 24).hit_tokens == 48


def test_generation_limits(tiny_template: Path) -> None:
    engine = make_engine(tiny_template, replay=True)
    assert engine.generate(FIRST, 0).token_ids == []
    assert len(engine.generate(FIRST, 1).token_ids) == 1
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], 4)


# -- (h) what a request costs the machine ------------------------------------------------------------------------


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_kv_pool_takes_memory_only_for_the_blocks_requests_use(tiny_template: Path) -> None:
    # 131,072 blocks of 16 KiB (k and v, 4 paged layers, 16 positions, 2 KV heads of 16 floats): a 2 GiB pool.
    num_blocks = 2 * 2**30 // (2 * 4 * BLOCK * 2 * 16 * 4)
    before = _resident_bytes()
    engine = make_engine(tiny_template, replay=False, num_blocks=num_blocks)
    assert engine.kv.bytes_per_block((0, 1, 2, 3)) * num_blocks == 2 * 2**30
    grown = _resident_bytes() - before
    assert grown < 256 * 2**20, f"constructing the engine made {grown / 2**20:.0f} MiB resident"
    assert engine.generate(SECOND, NEW_TOKENS).token_ids == cold_run(tiny_template, SECOND, replay=False)[0]
    assert _resident_bytes() - before < 256 * 2**20


def test_steps_too_small_to_share_run_on_one_thread(tiny_template: Path) -> None:
    engine = make_engine(tiny_template, replay=True)
    seen: list[tuple[int, int]] = []  # (positions in the step, threads it ran on)
    forward = engine.model.forward

    def recording(token_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append((token_ids.shape[0], torch.get_num_threads()))
        return forward(token_ids, *args)

    engine.model.forward = recording  # type: ignore[method-assign]
    # Long enough that its prefill gives two threads their share; one decoded token at a time never does.
    length = 2 * MACS_PER_THREAD // engine.model.layer_macs + 1
    for threads, prefill_threads in ((2, 2), (1, 1)):
        prompt = _prompt(70 + threads, length)
        torch.set_num_threads(threads)
        try:
            seen.clear()
            engine.generate(prompt, 4)
            assert torch.get_num_threads() == threads, "the request left torch's thread count changed"
        finally:
            torch.set_num_threads(1)
        assert seen == [(len(prompt), prefill_threads), (1, 1), (1, 1), (1, 1)]


# -- (i) other families against Hugging Face -------------------------------------------------------------------


def _family_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    architectures = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
    config: dict[str, Any] = {
        "architectures": [architectures[model_type]], "model_type": model_type, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 320, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 256, "eos_token_id": EOS, "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


FAMILIES = {
    # No q/k norms, tied embeddings (no lm_head tensor), llama3 RoPE scaling whose bands all occur at head_dim 16.
    "llama": _family_config(
        "llama", tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
    # Every layer slides (Mistral's older field, no layer_types).
    "mistral": _family_config("mistral", sliding_window=WINDOW),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    config = FAMILIES[name]
    tensors = make_tensors(Preset(config=config, num_shards=1, write_lm_head=False), seed=3)
    assert ("lm_head.weight" in tensors) == (name == "mistral")
    assert not any("q_norm" in t or "k_norm" in t for t in tensors)
    return name, write_tensors(tensors, config, tmp_path_factory.mktemp(name) / name, num_shards=1)


def test_family_matches_transformers(family_checkpoint: tuple[str, Path]) -> None:
    pytest.importorskip("transformers")
    from hf_reference import hf_greedy, hf_logits, hf_model, reference_logits

    name, checkpoint = family_checkpoint
    engine = make_engine(checkpoint, replay=True)
    config = engine.model_config
    assert not config.qk_norm and engine.model.layers[0].q_norm is None
    if name == "llama":
        assert config.layer_types == ("full_attention",) * 3 and config.tie_word_embeddings
        assert not engine.replay  # no sliding layers: nothing to replay
    else:
        assert config.layer_types == ("sliding_attention",) * 3 and config.sliding_window == WINDOW
    model = hf_model(checkpoint)
    for seed, length in ((70, 80), (71, 45)):
        prompt = _prompt(seed, length)
        ours = engine.prefill_logits(prompt)
        theirs = hf_logits(model, prompt)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        # The float64 naive reference agrees too (an oracle independent of transformers' masking code).
        torch.testing.assert_close(ours, reference_logits(checkpoint, prompt), atol=1e-4, rtol=0)
        cold = make_engine(checkpoint, replay=False).generate(prompt, NEW_TOKENS).token_ids
        assert cold == hf_greedy(model, prompt, NEW_TOKENS, EOS)[: len(cold)]


def test_family_prefix_hits(family_checkpoint: tuple[str, Path]) -> None:
    name, checkpoint = family_checkpoint
    prompt_a, prompt_b = _prompt(80, 100), [*_prompt(80, 100)[:90], *_prompt(81, 20)]
    cold = cold_run(checkpoint, prompt_b, replay=False)[0]
    off = make_engine(checkpoint, replay=False)
    off.generate(prompt_a, NEW_TOKENS)
    assert off.generate(prompt_b, NEW_TOKENS).token_ids == cold
    on = make_engine(checkpoint, replay=True)
    on.generate(prompt_a, NEW_TOKENS)
    hit = on.generate(prompt_b, NEW_TOKENS)
    assert hit.hit_tokens == 80 and hit.adopted
    if name == "llama":
        # Without sliding layers replay has nothing to rebuild: the hit is exact and only the tail is computed.
        assert hit.prefill_tokens == 30 and hit.replayed_tokens == 0 and hit.token_ids == cold
    else:
        # All-sliding: no layer keeps paged KV, and a hit still means "rebuild one window and go on".
        assert on.kv.k == {} and on.counters.swa_cached_bytes == 0
        assert hit.prefill_tokens == 30 + WINDOW and hit.replayed_tokens == WINDOW
        differing = sum(a != b for a, b in zip(hit.token_ids, cold, strict=True))
        print(f"\nmistral (all layers sliding) replay on vs cold: {differing}/{NEW_TOKENS} tokens differ")
