from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.base.errors import ModelLoadError
from mlxcel.base.messages import SamplingParams
from mlxcel.runtime.checkpoint import write_checkpoint
from mlxcel.runtime.compute import ComputeThread
from mlxcel.runtime.model import LayerRange, load_model, split_even
from mlxcel.runtime.sampling import make_sampler
from mlxcel.serving.frontend import StopStrings


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("parts", [2, 3])
def test_layer_ranges_equal_the_whole_model(
    checkpoints: dict[str, Path], family: str, parts: int
) -> None:
    lm = load_model(checkpoints[family])
    assert lm.family == family
    ranges = [LayerRange(lm, a, b) for a, b in split_even(lm.n_layers, parts)]
    assert ranges[0].is_first and ranges[-1].is_last and len(ranges) == parts
    caches = [r.make_cache() for r in ranges]
    ref_cache = make_prompt_cache(lm.model)

    def run_split(x: mx.array) -> mx.array:
        for r, c in zip(ranges, caches, strict=True):
            x = r(x, c)
        return x

    tokens = mx.array([[11, 42, 7, 300, 5, 99, 123, 64]])
    deltas = []
    ref = lm.model(tokens, cache=ref_cache)  # mlx-lm's own forward pass is the reference
    out = run_split(tokens)
    assert out.shape == ref.shape == (1, 8, lm.config["vocab_size"])
    deltas.append(mx.abs(out - ref).max().item())
    for _ in range(5):  # decode steps reuse both sets of caches
        nxt = mx.argmax(ref[:, -1:, :], axis=-1)
        ref = lm.model(nxt, cache=ref_cache)
        out = run_split(nxt)
        deltas.append(mx.abs(out - ref).max().item())
    assert max(deltas) <= 1e-4, deltas
    assert ref.dtype == mx.float32


def test_middle_range_maps_hidden_to_hidden(tiny: Path) -> None:
    lm = load_model(tiny)
    mid = LayerRange(lm, 1, 3)
    h = mx.random.normal((1, 4, lm.hidden_size))
    assert mid(h, mid.make_cache()).shape == (1, 4, lm.hidden_size)
    with pytest.raises(ValueError):
        LayerRange(lm, 2, 2)
    with pytest.raises(ValueError):
        LayerRange(lm, 0, lm.n_layers + 1)
    with pytest.raises(ValueError):
        split_even(4, 5)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_checkpoints_are_deterministic_and_in_hf_layout(tmp_path: Path) -> None:
    a = write_checkpoint(tmp_path / "a", "tiny", "llama", seed=3)
    b = write_checkpoint(tmp_path / "b", "tiny", "llama", seed=3)
    c = write_checkpoint(tmp_path / "c", "tiny", "llama", seed=4)
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]
    assert _digest(a)["tokenizer.json"] == _digest(c)["tokenizer.json"]
    names = {p.name for p in a.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    index = json.loads((a / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    tok_cfg = json.loads((a / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_cfg
    lm = load_model(a)
    ids = lm.tokenizer.encode("hello world")
    assert lm.tokenizer.decode(ids) == "hello world"
    assert (
        len(
            lm.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], add_generation_prompt=True
            )
        )
        > 3
    )


def test_sharded_and_quantized_checkpoints_load(tmp_path: Path) -> None:
    sharded = write_checkpoint(tmp_path / "s", "tiny", "qwen3", shard_bytes=200_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    lm = load_model(sharded)
    assert lm.model(mx.array([[1, 2, 3]])).shape == (1, 3, 512)
    q = write_checkpoint(tmp_path / "q", "tiny", "qwen3", quantize=8)
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 8
    lmq = load_model(q)
    assert lmq.model(mx.array([[1, 2, 3]])).shape == (1, 3, 512)


def test_load_errors_are_typed(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path)


def test_seeded_sampling_reproduces_and_top_k_1_is_greedy() -> None:
    logits = mx.random.normal((1, 512))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = SamplingParams(temperature=1.0, seed=42)
    a, b = make_sampler(p), make_sampler(p)
    assert a is not None and b is not None
    seq_a = [a(logprobs).item() for _ in range(20)]
    seq_b = [b(logprobs).item() for _ in range(20)]
    assert seq_a == seq_b and len(set(seq_a)) > 1
    other = make_sampler(SamplingParams(temperature=1.0, seed=43))
    assert other is not None and [other(logprobs).item() for _ in range(20)] != seq_a
    k1 = make_sampler(SamplingParams(temperature=0.8, top_k=1, seed=1))
    assert k1 is not None and k1(logprobs).item() == mx.argmax(logprobs, axis=-1).item()
    nucleus = make_sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=1))
    assert nucleus is not None and nucleus(logprobs).item() == mx.argmax(logprobs, axis=-1).item()
    assert make_sampler(SamplingParams(temperature=0.0)) is None


def test_stop_strings_hold_back_partial_matches() -> None:
    s = StopStrings(["END", "xyz"])
    assert s.feed("hello E") == ("hello ", False)
    assert s.feed("N") == ("", False)
    assert s.feed("Dless") == ("", True)
    s = StopStrings(["END"])
    assert s.feed("abc EN") == ("abc ", False)
    assert s.feed("x") == ("ENx", False)
    assert s.flush() == ""
    s = StopStrings(["END"])
    assert s.feed("ab E") == ("ab ", False)
    assert s.flush() == "E"
    assert StopStrings([]).feed("END") == ("END", False)


async def test_reactor_keeps_ticking_during_a_long_prefill(tiny: Path) -> None:
    """A 4096-token prefill on the compute thread must not stall a ticking task."""
    compute = ComputeThread()
    try:
        lm = await compute.run(load_model, tiny)
        full = LayerRange(lm, 0, lm.n_layers)
        loop = asyncio.get_running_loop()
        ticks: list[float] = []
        done = False

        async def tick() -> None:
            while not done:
                ticks.append(loop.time())
                await asyncio.sleep(0.005)

        def prefill() -> float:
            import time

            # Made here: MLX arrays belong to the thread whose stream built them. Repeated
            # until it lasts long enough to matter, however fast the device.
            tokens = mx.array([[i % 500 for i in range(4096)]])
            t0 = time.perf_counter()
            for _ in range(200):
                mx.eval(full(tokens, full.make_cache()))
                if time.perf_counter() - t0 > 0.5:
                    break
            return time.perf_counter() - t0

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        t_start = loop.time()
        took = await compute.run(prefill)
        t_end = loop.time()
        done = True
        await ticker
        during = [t for t in ticks if t_start <= t <= t_end]
        assert took > 0.1, "prefill too short to prove anything"
        # While the compute thread ran, the reactor kept running: a reactor blocked by the
        # compute (an evaluation holding the GIL) would tick once or not at all. How evenly it
        # ticks is a performance figure, for the benchmarks, not asserted here.
        assert len(during) >= 3, (len(during), took)
    finally:
        compute.close()
