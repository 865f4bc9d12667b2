"""How live the gateway stays under attack: `/v1/models` latency while a victim streams, first
alone (the baseline), then with an attacker sending hostile input as fast as it can.

One stack (`switchboard up`'s processes: Redis, one worker, the gateway) with the default
model (`switchboard model prepare`). Phase 1: a victim tenant asks greedy completions in a
loop and a prober reads `/v1/models` every 10 ms for S seconds. Phase 2:
the same, while A attacker threads cycle through hostile requests: bodies declaring a
gigabyte, 3 MB prompts, extreme sampling values, archive
bombs, pathological `target_modules` regexes, half-sent headers held open (slowloris).
Reports p50/p99/max of the probe in both phases, the ratio of the p99s, how many attacks got
a 4xx, how many connections the server closed without an answer (the half-sent headers:
`SWITCHBOARD_HTTP_HEADER_TIMEOUT_S`) and any other outcome, and whether every victim answer
was identical.

Usage: ``python -m bench.hostile_latency [--seconds 10] [--attackers 4]``.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import socket
import tarfile
import tempfile
import threading
import time
import zipfile
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from bench.report import write_report
from runtime.embedded_redis import free_port
from runtime.home import default_model_dir
from runtime.stack import Stack


def percentiles(values: list[float]) -> dict[str, float]:
    return {
        "probes": len(values),
        "p50_ms": float(np.percentile(values, 50) * 1e3),
        "p99_ms": float(np.percentile(values, 99) * 1e3),
        "max_ms": float(np.max(values) * 1e3),
    }


def probe(base_url: str, key: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get("/v1/models", timeout=30).raise_for_status()
            out.append(time.perf_counter() - started)
            time.sleep(0.01)


def victim(base_url: str, key: str, model: str, stop: threading.Event, out: list[str]) -> None:
    body = {"model": model, "prompt": "the victim", "max_tokens": 48, "temperature": 0}
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}) as client:
        while not stop.is_set():
            response = client.post("/v1/completions", json=body, timeout=120)
            out.append(response.json()["choices"][0]["text"] if response.is_success else "")


def raw(port: int, data: bytes, *, hold: bool = False) -> int:
    """Sends raw bytes, then stops sending (or, with `hold`, stays silent until the server
    closes); returns the status code answered (0: closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        try:
            sock.sendall(data)
            if not hold:
                sock.shutdown(socket.SHUT_WR)
            answer = sock.recv(4096)
        except OSError:
            return 0
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0


def attacks(port: int, model: str) -> list:
    """Callables returning a status code; each is one hostile request."""
    url = f"http://127.0.0.1:{port}"

    def zip_bomb() -> bytes:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("adapter_config.json", b"{}")
            zf.writestr("adapter_model.safetensors", b"\0" * (300 << 20))
        return buffer.getvalue()

    def regex_archive() -> bytes:
        config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": "(a*)*" * 8}
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for name, data in [
                ("adapter_config.json", json.dumps(config).encode()),
                ("adapter_model.safetensors", b"\x02\0\0\0\0\0\0\0{}"),
            ]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return buffer.getvalue()

    bomb, regex = zip_bomb(), regex_archive()

    def make(key: str) -> list:
        def call(path: str, **kwargs):
            return lambda: (
                httpx.post(
                    url + path, headers={"Authorization": f"Bearer {key}"}, timeout=60, **kwargs
                ).status_code
            )

        huge = b"Content-Length: 1073741824\r\n\r\n{"
        return [
            lambda: raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + huge),
            lambda: raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", hold=True),
            call("/v1/completions", json={"model": model, "prompt": "a" * 3_000_000}),
            call("/v1/completions", json={"model": model, "prompt": "x", "n": 10**6}),
            call(
                "/v1/completions",
                json={"model": model, "prompt": "x", "repetition_penalty": 1e30, "max_tokens": 4},
            ),
            call("/v1/completions", json={"model": model, "prompt": "x", "stop": ["s"] * 10**4}),
            call("/v1/adapters", data={"name": "bomb"}, files={"file": ("a.zip", bomb)}),
            call("/v1/adapters", data={"name": "re"}, files={"file": ("a.tar.gz", regex)}),
        ]

    return make


def attacker(make, key: str, stop: threading.Event, outcomes: Counter) -> None:
    for attack in itertools.cycle(make(key)):
        if stop.is_set():
            return
        try:
            status = attack()
        except httpx.HTTPError:
            status = 0
        outcomes["4xx" if 400 <= status < 500 else "closed" if status == 0 else "other"] += 1


def phase(stack: Stack, keys: dict, model: str, *, seconds: float, make=None, attackers=0):
    stop, latencies, texts, outcomes = threading.Event(), [], [], Counter()
    threads = [
        threading.Thread(target=probe, args=(stack.base_url, keys["victim"], stop, latencies)),
        threading.Thread(target=victim, args=(stack.base_url, keys["victim"], model, stop, texts)),
    ]
    threads += [
        threading.Thread(target=attacker, args=(make, keys["attacker"], stop, outcomes))
        for _ in range(attackers)
    ]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    return {**percentiles(latencies), "victim_texts": texts, "attacks": dict(outcomes)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--attackers", type=int, default=4)
    args = parser.parse_args(argv)
    model = default_model_dir()
    if not (model / "config.json").is_file():
        raise SystemExit("run `switchboard model prepare` first")
    with tempfile.TemporaryDirectory() as home:
        port = free_port()
        with Stack(model=model, gateway_port=port, home=Path(home), key_prefix="sbhostile:") as s:
            keys = {t: s.create_tenant_key(t) for t in ("victim", "attacker")}
            name = model.name
            quiet = phase(s, keys, name, seconds=args.seconds)
            loud = phase(
                s,
                keys,
                name,
                seconds=args.seconds,
                make=attacks(port, name),
                attackers=args.attackers,
            )
    texts = set(quiet.pop("victim_texts")) | set(loud.pop("victim_texts"))
    result = {
        "baseline": quiet,
        "under_attack": loud,
        "p99_ratio": loud["p99_ms"] / quiet["p99_ms"],
        "victim_identical": len(texts) == 1,
    }
    print(json.dumps(result, indent=2))
    write_report("hostile_latency", result)
    return result


if __name__ == "__main__":
    main()
