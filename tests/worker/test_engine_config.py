"""EngineConfig: settings checked when made, before any model is read."""

import pytest

from worker.core.config import (
    EngineConfig,
    FairnessConfig,
    PreemptionMode,
    SpeculativeConfig,
    engine_config,
)
from worker.errors import InvalidRequestError, SpeculativeConfigError


def test_flat_options_build_the_nested_config():
    config = engine_config(
        dtype="float32",
        num_kv_blocks=64,
        preemption_mode="swap",
        speculative_model="ngram",
        num_speculative_tokens=3,
        speculative_alternatives=0,
        fairness=FairnessConfig(policy="fcfs"),
    )
    assert config.num_kv_blocks == 64 and config.preemption_mode is PreemptionMode.SWAP
    assert config.speculative == SpeculativeConfig(model="ngram", num_tokens=3, alternatives=0)
    assert config.fairness.policy == "fcfs"
    assert engine_config(fairness=None).fairness == FairnessConfig()
    assert not EngineConfig().speculative.enabled and SpeculativeConfig("ngram").k == 4


def test_bad_settings_fail_when_made_without_reading_a_model():
    with pytest.raises(TypeError, match="unknown engine options: max_num_seq"):
        engine_config(max_num_seq=4)
    with pytest.raises(InvalidRequestError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(InvalidRequestError, match="num_kv_blocks"):
        EngineConfig(num_kv_blocks=0)
    with pytest.raises(InvalidRequestError, match="burst_prefill_tokens"):
        EngineConfig(burst_prefill_tokens=0)
    with pytest.raises(ValueError):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(SpeculativeConfigError, match="speculative_model is not"):
        engine_config(num_speculative_tokens=2)
    with pytest.raises(SpeculativeConfigError, match="num_speculative_tokens must be"):
        SpeculativeConfig("ngram", num_tokens=0)
    with pytest.raises(SpeculativeConfigError, match="must be >= 0"):
        SpeculativeConfig("ngram", draft_cost=-1.0)
