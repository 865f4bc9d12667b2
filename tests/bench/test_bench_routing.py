"""bench/routing.py's inputs: its adapters are valid PEFT adapters of the tiny checkpoint (the
adapter reader accepts them), and its trace is seeded and Zipf-skewed."""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter

from adapters import BaseModelSpec, load_adapter_dir
from bench.routing import make_trace, write_adapters
from worker.model.tiny_families import make_servable_checkpoint


def test_adapters_fit_the_checkpoint_and_differ(tmp_path):
    model = make_servable_checkpoint(tmp_path / "tiny", "qwen3")
    spec = BaseModelSpec.from_config_dict(json.loads((model / "config.json").read_text()))
    paths = write_adapters(model, tmp_path / "peft", 3)
    ids = {load_adapter_dir(p, base=spec, max_lora_rank=64, max_bytes=64 << 20).id for p in paths}
    assert len(ids) == 3


def test_the_trace_is_seeded_and_zipf_skewed():
    args = argparse.Namespace(seed=0, adapters=32, zipf=1.1, rate=3.0, requests=2000)
    trace = make_trace(args, vocab=512)
    assert trace == make_trace(args, vocab=512)
    counts = Counter(a.adapter for a in trace)
    assert counts[0] > counts[1] > counts[7] and counts[0] > 0.15 * len(trace)
    assert all(a.at_s < b.at_s for a, b in itertools.pairwise(trace))
    assert all(32 <= len(a.prompt) <= 96 for a in trace)
