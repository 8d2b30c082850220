"""mlx-lm's options under mlx-lm's names, built on mlx-lm's implementations: a LoRA adapter
and a bounded (rotating) KV cache in ``generate`` and ``serve``; a quantized KV cache and
speculative decoding in ``generate`` (mlx-lm's one-stream path); each refused by name where
the mode cannot apply it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest

from tests.cli.test_cli import run_cli


def write_adapter(model: Path, out: Path) -> Path:
    """A LoRA adapter for ``model`` in mlx-lm's format, its B matrices random (not zero, as a
    fresh one's are) so that it changes what the model says."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    cfg = {"fine_tune_type": "lora", "num_layers": 4,
           "lora_parameters": {"rank": 4, "scale": 20.0, "dropout": 0.0}}  # fmt: skip
    net, _ = load(str(model))
    net.freeze()
    linear_to_lora_layers(net, cfg["num_layers"], cfg["lora_parameters"])
    weights = dict(tree_flatten(net.trainable_parameters()))
    for i, name in enumerate(sorted(weights)):
        weights[name] = mx.random.normal(weights[name].shape, key=mx.random.key(3 + i))
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


PROMPT = "tell me about the weather in paris and in london today, and tomorrow too"


def generate(model: Path, *flags: str) -> tuple[str, str]:
    """(the text, the stats line) of a greedy ``generate`` of 16 tokens after PROMPT."""
    r = run_cli("generate", "-m", str(model), "-p", PROMPT, "--raw", "-n", "16", *flags)
    assert r.returncode == 0, r.stderr
    text, stats = r.stdout.rstrip("\n").rsplit("\n", 1)
    return text, stats


@pytest.fixture(scope="module")
def adapter(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_adapter(tiny, tmp_path_factory.mktemp("lora") / "adapter")


def test_a_lora_adapter_changes_generate_and_serve_alike(
    tiny: Path, adapter: Path, start_server
) -> None:  # type: ignore[no-untyped-def]
    plain, _ = generate(tiny)
    tuned, _ = generate(tiny, "--adapter-path", str(adapter))
    assert tuned != plain
    srv = start_server(["-m", str(tiny), "--adapter-path", str(adapter)])
    assert "LoRA adapter" in srv.output
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    r = c.completions.create(model=tiny.name, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == tuned  # the engine serves what generate printed


def test_an_adapter_for_another_model_is_refused_by_its_flag(
    tiny: Path, adapter: Path, tmp_path: Path
) -> None:
    import shutil

    wrong = tmp_path / "wrong"
    shutil.copytree(adapter, wrong)
    cfg = json.loads((wrong / "adapter_config.json").read_text())
    cfg["lora_parameters"]["rank"] = 8  # its tensors are rank 4
    (wrong / "adapter_config.json").write_text(json.dumps(cfg))
    r = run_cli("generate", "-m", str(tiny), "-p", "hi", "--adapter-path", str(wrong))
    assert r.returncode == 2 and "--adapter-path" in r.stderr and "does not fit tiny" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_bounded_kv_cache_rotates_in_generate_and_serve(tiny: Path, start_server) -> None:  # type: ignore[no-untyped-def]
    full, _ = generate(tiny)
    bounded, stats = generate(tiny, "--max-kv-size", "16")
    assert bounded != full and "generated tokens: 16" in stats  # the prompt alone fills 16
    srv = start_server(["-m", str(tiny), "--max-kv-size", "16"])
    assert "KV cache: at most 16 tokens a sequence (rotating)" in srv.output
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    r = c.completions.create(model=tiny.name, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == bounded


def test_speculative_decoding_is_mlx_lm_s_and_keeps_greedy_output(
    tiny: Path, tmp_path: Path
) -> None:
    plain, _ = generate(tiny)
    text, stats = generate(tiny, "--draft-model", str(tiny), "--num-draft-tokens", "3")
    assert text == plain  # a draft changes how fast, never what, greedy decoding says
    accepted = re.search(r"draft tokens accepted: (\d+) of (\d+)", stats)
    assert accepted and int(accepted[1]) > 0  # its own draft: most tokens accepted
    from tests.rigged import write_rigged

    other = write_rigged(tmp_path / "rigged").path  # three tokens more: another tokenizer
    r = run_cli("generate", "-m", str(tiny), "-p", "hi", "--draft-model", str(other))
    assert r.returncode == 2 and "--draft-model" in r.stderr
    assert "its tokenizer differs" in r.stderr and "Traceback" not in r.stderr


def test_a_quantized_kv_cache_in_generate(tmp_path: Path) -> None:
    """mlx-lm's quantized KV cache groups along the head dimension: a checkpoint whose heads
    hold 32 values runs it with groups of 32, and refuses 64 by name."""
    from mlxcel.runtime import checkpoint

    shapes = dict(checkpoint.SHAPES)
    checkpoint.SHAPES["hd32"] = checkpoint.Shape(64, 2, 2, 1, 32, 128, 512, 512, "float32", 4096)
    try:
        model = checkpoint.write_checkpoint(tmp_path / "hd32", "hd32")
    finally:
        checkpoint.SHAPES.clear()
        checkpoint.SHAPES.update(shapes)
    _, stats = generate(model, "--kv-bits", "8", "--kv-group-size", "32",
                        "--quantized-kv-start", "0")  # fmt: skip
    assert "generated tokens: " in stats
    r = run_cli("generate", "-m", str(model), "-p", "hi", "--kv-bits", "4")
    assert r.returncode == 2, r.stderr
    assert "--kv-group-size: 64 does not divide hd32's head dimension 32" in r.stderr


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["serve", "--kv-bits", "4"],
            "--kv-bits: serve batches requests with mlx-lm's BatchGenerator, which has no quantized KV cache",
        ),
        (["serve", "--draft-model", "."], "--draft-model: serve batches requests"),
        (["generate", "--kv-bits", "7"], "--kv-bits: 7 is not one of 2, 3, 4, 5, 6, 8"),
        (
            ["generate", "--kv-group-size", "32"],
            "--kv-group-size is for a quantized KV cache: give --kv-bits",
        ),
        (["generate", "--num-draft-tokens", "2"], "--num-draft-tokens is for speculative decoding"),
        (
            ["generate", "--draft-model", ".", "--max-kv-size", "64"],
            "--max-kv-size does not combine with --draft-model",
        ),
        (["serve", "--max-kv-size", "64", "--pp-size", "2"], "--max-kv-size is for one process"),
        (["serve", "--max-kv-size", "8"], "--max-kv-size"),
        (
            ["serve", "--num-draft-tokens", "2"],
            "--num-draft-tokens: serve batches requests with mlx-lm's BatchGenerator, which has no speculative decoding",
        ),
        (
            ["serve", "--max-kv-size", "64", "--prompt-cache-bytes", "1MiB"],
            "--prompt-cache-bytes does not combine with --max-kv-size",
        ),
        (
            ["generate", "-p", "hi", "-m", "100"],
            "100 (-m is the model here; the token count is -n/--max-tokens",
        ),
        (["generate", "--adapter-path", "."], "not a LoRA adapter folder (no adapter_config.json)"),
        (["generate", "--adapter-path", "/nonexistent/lora"], "/nonexistent/lora: no such folder"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_mlx_lm_options_are_refused_by_name(argv: list[str], needle: str) -> None:
    r = run_cli(*argv)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
