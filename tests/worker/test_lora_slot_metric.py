"""The worker's slot state in the metric the Gateway API Inference Extension reads from vLLM:
`vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}`, its value
the time of the sample."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from worker.engine.engine_stats import EngineStats
from worker.model.lora_manager import AdapterResidency
from worker.serving.metrics import EngineStatsCollector, lora_requests_info

A, B, C = "a" * 64, "b" * 64, "c" * 64


def stats(slots, waiting=()) -> EngineStats:
    return EngineStats(
        running=1, waiting=len(waiting), free_kv_blocks=1, total_kv_blocks=2,
        adapter_ids=tuple(s for s in slots if s), residency=AdapterResidency(slots=tuple(slots)),
        waiting_adapters=tuple(waiting),
    )  # fmt: skip


def test_labels_list_running_and_waiting_adapters_and_the_slot_count():
    metric = lora_requests_info(stats([A, None, B, None], waiting=[C]), now=1234.5)
    (sample,) = metric.samples
    assert sample.name == "vllm:lora_requests_info" and sample.value == 1234.5
    assert sample.labels == {
        "running_lora_adapters": f"{A},{B}",
        "waiting_lora_adapters": C,
        "max_lora": "4",
    }


def test_the_collector_exposes_it():
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats([None, None])))
    text = generate_latest(registry).decode()
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line
