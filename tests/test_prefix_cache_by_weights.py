"""The reference engine's prefix cache is keyed by the weights: after the engine's weights change, no block
computed under the old ones can hit (in process, on real tiny checkpoints loaded from disk).

The daemon end of it (a served engine switching between daemons, under load) is tests/test_switch.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from wcache.engine import Engine, EngineConfig
from wcache.engine.block_manager import BlockManager, chain_hashes, weights_root
from wcache.engine.model import Transformer
from wcache_dev.synth import write_checkpoint

# 80 tokens of shared prefix (five blocks of 16, past tiny's 32-token window) then a tail.
PROMPT = [*range(40, 120), 7, 8, 9]


def test_blocks_recorded_under_other_weights_never_match() -> None:
    a, b = "a" * 64, "b" * 64
    assert weights_root(a) != weights_root(b) != weights_root(None)
    tokens = list(range(8))
    under_a, under_b = chain_hashes(tokens, 4, weights_root(a)), chain_hashes(tokens, 4, weights_root(b))
    assert not set(under_a) & set(under_b), "the same tokens under other weights must hash apart"
    manager = BlockManager(4, 4)
    block = manager.allocate()
    assert manager.register(block, under_a[0], a)
    manager.release([block])
    assert manager.match(under_a[:1], a) == [block]
    # Even the very hash (a collision, or a caller that forgot the root) is refused under other weights.
    assert manager.match(under_a[:1], b) == []
    assert manager.cross_version_refusals == 1


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_new_weights_never_hit_the_old_weights_blocks(tmp_path: Path, replay: bool) -> None:
    config = EngineConfig(num_blocks=64, swa_bounded_replay=replay)
    old = Engine.from_disk(write_checkpoint("tiny", tmp_path / "old", seed=0), engine_config=config)
    new = Engine.from_disk(write_checkpoint("tiny", tmp_path / "new", seed=1), engine_config=config)
    cold_new = new.generate(PROMPT, 4).token_ids
    assert old.generate(PROMPT, 4).hit_tokens == 0
    assert old.generate(PROMPT, 4).hit_tokens == 80, "the old weights' own repeat hits"

    old_key, new_key = old.served.key_id, new.served.key_id
    assert old_key is not None and new_key is not None and old_key != new_key
    # The old engine now runs the new checkpoint's weights (what a switch installs).
    old.install(Transformer(new.model_config, new.model.weights, old.tp), new.tokenizer, new.served, None)
    after = old.generate(PROMPT, 4)
    assert after.hit_tokens == 0, "a block computed under the old weights hit after the weights changed"
    assert after.token_ids == cold_new and after.weights_key == new_key
    assert old.generate(PROMPT, 4).hit_tokens == 80, "the new weights' own repeat hits"
    by_key = {k: (c.prefix_queries, c.prefix_hits) for k, c in old.weights_counters.items()}
    assert by_key == {old_key: (2 * len(PROMPT), 80), new_key: (2 * len(PROMPT), 80)}
    assert old.blocks.cross_version_refusals == 0
