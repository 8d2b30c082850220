"""The family matrix: every supported mlx-lm family in every distributed mode, against one
process, token for token -- or a documented refusal (docs/families.md has the table).

Each family gets a tiny random-weight checkpoint that keeps its real structure (experts with
top-k > 1, shared experts, a dense first layer, MLA, sliding and full layers, linear attention,
attention residuals); prompts outgrow the 8-token sliding windows so rotating caches rotate.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from contextlib import AsyncExitStack, aclosing
from pathlib import Path
from typing import Any

import pytest

from mlxcel.base.errors import ConfigError, EngineError, ModelLoadError
from mlxcel.base.messages import ErrorCode, SamplingParams
from mlxcel.net.secret import ClusterSecret, load_cluster_secret
from mlxcel.pipeline.cluster_config import load_cluster_config
from mlxcel.pipeline.launch import LoopbackCluster
from mlxcel.runtime.checkpoint import FAMILIES, write_checkpoint
from mlxcel.runtime.families import SUPPORTED_FAMILIES, TP_FAMILIES
from mlxcel.serving.assembly import (
    CoordinatorSpec,
    DisaggSpec,
    Generation,
    LocalSpec,
    PipelineSpec,
    assemble,
)
from mlxcel.tp.group import check_shardable
from tests.conftest import free_port, until_true

ROOT = Path(__file__).resolve().parents[2]
# Families whose caches are all plain KV caches: a prefill node can hand them to a decode node.
HANDOFF = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2",
           "glm4_moe", "mixtral", "phi3")  # fmt: skip
PROMPTS = [
    "Families split over stages",
    "A longer prompt, so that the sliding window of eight tokens rotates: one two three four",
    "Experts",
]
# One request with every sampling feature a stage applies: a seeded draw, filters, penalties,
# a bias and logprobs with alternatives.
SAMPLED = SamplingParams(
    temperature=0.8,
    seed=11,
    top_p=0.9,
    min_p=0.02,
    max_tokens=10,
    logprobs=True,
    top_logprobs=2,
    repetition_penalty=1.3,
    presence_penalty=0.5,
    logit_bias_ids=(5,),
    logit_bias_values=(2.0,),
)


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: write_checkpoint(root / f, "tiny", f) for f in FAMILIES}


async def answers(st: Any) -> dict[str, Any]:
    """Greedy tokens of every prompt (run concurrently, so decode steps batch) and one sampled
    stream's tokens and logprobs."""
    fe = st.frontend

    async def one(prompt: str, params: SamplingParams) -> tuple[list[int], list[float]]:
        toks: list[int] = []
        lps: list[float] = []
        async with aclosing(fe.stream(fe.encode_prompt(prompt), params)) as it:
            async for d in it:
                toks.extend(d.token_ids)
                lps.extend(d.logprobs or ())
        return toks, lps

    greedy = await asyncio.gather(*(one(p, SamplingParams(max_tokens=12)) for p in PROMPTS))
    sampled, lps = await one(PROMPTS[1], SAMPLED)
    return {"greedy": [g[0] for g in greedy], "sampled": sampled, "logprobs": lps}


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["greedy"] == want["greedy"]
    assert got["sampled"] == want["sampled"]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


@pytest.fixture(scope="module")
def reference(family_models: dict[str, Path]) -> dict[str, dict[str, Any]]:
    async def run(model: Path) -> dict[str, Any]:
        async with assemble(LocalSpec(model), Generation(parallel=4)) as st:
            return await answers(st)

    return {f: asyncio.run(run(m)) for f, m in family_models.items()}


def test_every_listed_family_has_a_checkpoint_and_an_adapter() -> None:
    want = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma3_text",
            "deepseek_v3", "kimi_k2", "kimi_k3", "glm4_moe", "gpt_oss", "mixtral", "phi3"}  # fmt: skip
    assert want <= set(FAMILIES) and want <= set(SUPPORTED_FAMILIES)


def test_checkpoints_keep_each_familys_structure(family_models: dict[str, Path]) -> None:
    cfg = {f: json.loads((m / "config.json").read_text()) for f, m in family_models.items()}
    moe = cfg["qwen3_moe"]
    assert moe["num_experts"] >= 4 and moe["num_experts_per_tok"] > 1
    ds = cfg["deepseek_v3"]
    assert ds["first_k_dense_replace"] == 1 and ds["n_shared_experts"] >= 1
    assert ds["kv_lora_rank"] < ds["hidden_size"]  # MLA's compressed latent
    gemma = cfg["gemma3_text"]
    assert (
        gemma["num_hidden_layers"] >= gemma["sliding_window_pattern"]
        and gemma["tie_word_embeddings"]
    )
    oss = cfg["gpt_oss"]
    assert {"sliding_attention", "full_attention"} == set(oss["layer_types"])
    q35 = cfg["qwen3_5"]["text_config"]
    assert q35["num_hidden_layers"] // q35["full_attention_interval"] >= 2
    k3 = cfg["kimi_k3"]["text_config"]
    kda = k3["linear_attn_config"]["kda_layers"]
    assert 0 < len(kda) < k3["num_hidden_layers"] and k3["attn_res_block_size"]
    # An untied head has weights of its own; a tied one has none.
    for f, m in family_models.items():
        names = json.loads((m / "model.safetensors.index.json").read_text())["weight_map"]
        tied = cfg[f].get("tie_word_embeddings")
        assert any(n.rpartition("lm_head.")[1] for n in names) != bool(tied), f


@pytest.mark.parametrize("layout", ["2", "3", "explicit"])
@pytest.mark.parametrize("family", FAMILIES)
async def test_pipeline_in_one_process_gives_one_process_tokens(
    family_models: dict[str, Path], reference: dict[str, Any], family: str, layout: str
) -> None:
    model = family_models[family]
    n = json.loads((model / "config.json").read_text())
    n_layers = n.get("text_config", n)["num_hidden_layers"]
    if layout == "explicit":  # an uneven cut: one layer, then the rest
        spec = PipelineSpec(model, 2, layers=f"0-0,1-{n_layers - 1}")
    else:
        spec = PipelineSpec(model, int(layout))
    async with assemble(spec, Generation(parallel=4)) as st:
        same(await answers(st), reference[family])
        await until_true(lambda: all(not s.seqs for s in st.parts.stages))  # all released


@pytest.mark.parametrize("family", FAMILIES)
async def test_stage_processes_from_a_cluster_toml_give_one_process_tokens(
    family_models: dict[str, Path], reference: dict[str, Any], family: str
) -> None:
    model = family_models[family]
    with tempfile.TemporaryDirectory(prefix="mlxcel-family-") as tmp:
        async with LoopbackCluster(model, 2, Path(tmp), spawn_coordinator=False) as cl:
            cfg = load_cluster_config(cl.config)
            secret = load_cluster_secret(None, {}, cl.config)
            assert secret is not None
            spec = CoordinatorSpec(cfg, cfg.coordinator, model, secret)
            async with assemble(spec, Generation(parallel=4)) as st:
                same(await answers(st), reference[family])


async def _disagg(model: Path) -> AsyncExitStack:
    secret = ClusterSecret(bytes(range(32)), "test")
    pa, da, ra = (f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (22, 23, 24))
    stack = AsyncExitStack()
    pre = await stack.enter_async_context(
        assemble(DisaggSpec("prefill", model, secret, pa, (), (da,)))
    )
    dec = await stack.enter_async_context(assemble(DisaggSpec("decode", model, secret, da)))
    for node in (pre, dec):
        await node.parts.listener.start()
        stack.push_async_callback(node.parts.listener.close)
    router = DisaggSpec("router", model, secret, ra, (pa,), (da,), startup_timeout=20)
    rt = await stack.enter_async_context(assemble(router))
    await rt.parts.listener.start()
    stack.push_async_callback(rt.parts.listener.close)
    stack.router = rt  # type: ignore[attr-defined]
    stack.prefill = pre  # type: ignore[attr-defined]
    return stack


@pytest.mark.parametrize("family", FAMILIES)
async def test_disaggregated_serving_hands_off_or_refuses_each_request_cleanly(
    family_models: dict[str, Path], reference: dict[str, Any], family: str
) -> None:
    stack = await _disagg(family_models[family])
    async with stack:
        rt = stack.router  # type: ignore[attr-defined]
        if family in HANDOFF:
            same(await answers(rt), reference[family])
            return
        for _ in range(2):  # refused per request, before any prefill work; the node serves on
            with pytest.raises(EngineError) as err:
                await answers(rt)
            assert err.value.code == ErrorCode.UNSUPPORTED_MODEL
            assert "cannot be handed off" in str(err.value) and family in str(err.value)
        assert stack.prefill.parts.engine.prompt_tokens == 0  # type: ignore[attr-defined]
        assert rt.parts.service.router.online("prefill")


def _generate(model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", "generate", "-m", str(model), "-p", PROMPTS[1],
         "-n", "12", *extra],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.parametrize("family", [f for f in FAMILIES if f in TP_FAMILIES])
def test_tensor_parallel_over_two_ranks_prints_one_process_tokens(
    family_models: dict[str, Path], family: str
) -> None:
    model = family_models[family]
    # Greedy, then a seeded draw through top-p and top-k: every rank samples the same token.
    for flags in ((), ("--temp", "0.8", "--seed", "7", "--top-p", "0.9", "--top-k", "40")):
        single, tp = _generate(model, *flags), _generate(model, *flags, "--tp-size", "2")
        assert single.returncode == 0 and tp.returncode == 0, tp.stderr[-2000:]
        assert tp.stdout.rsplit("\n", 2)[0] == single.stdout.rsplit("\n", 2)[0], flags


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in TP_FAMILIES])
def test_families_mlx_lm_cannot_shard_are_refused_for_tensor_parallel(
    family_models: dict[str, Path], family: str
) -> None:
    config = json.loads((family_models[family] / "config.json").read_text())
    with pytest.raises(ConfigError, match=f"family '{family}' has no tensor-parallel path"):
        check_shardable(config, 2)


def test_a_tp_size_that_does_not_divide_the_experts_is_named(
    family_models: dict[str, Path],
) -> None:
    config = json.loads((family_models["qwen3_moe"] / "config.json").read_text())
    config["moe_intermediate_size"] = 18
    with pytest.raises(ConfigError, match=r"MoE intermediate size 18"):
        check_shardable(config, 4)
    k3 = json.loads((family_models["kimi_k3"] / "config.json").read_text())
    k3["text_config"]["linear_attn_config"]["num_heads"] = 3
    with pytest.raises(ConfigError, match=r"linear-attention heads 3 not divisible by 2"):
        check_shardable(k3, 2)


def test_tp_refusal_comes_before_any_weight_loads(family_models: dict[str, Path]) -> None:
    r = _generate(family_models["gemma3_text"], "--tp-size", "2")
    assert r.returncode == 2
    assert "gemma3_text" in r.stderr and "--pp-size" in r.stderr
    assert "loaded model" not in r.stderr


def test_an_unsupported_family_is_refused_before_any_weight_loads(
    family_models: dict[str, Path], tmp_path: Path
) -> None:
    model = tmp_path / "olmo"
    model.mkdir()
    for f in family_models["qwen3"].iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "model_type": "olmo3"}))
    r = _generate(model, "--pp-size", "2")
    assert r.returncode != 0
    assert "family 'olmo3' has no layer-range executor" in r.stderr
    assert "kimi_k3" in r.stderr and "loaded model" not in r.stderr

    async def build() -> None:
        async with assemble(PipelineSpec(model, 2)):
            pass

    with pytest.raises(ModelLoadError, match="olmo3"):
        asyncio.run(build())


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def test_a_stage_process_holds_its_share_of_the_model(tmp_path: Path) -> None:
    """A stage reads only its own layers' weights: measured as resident memory of the stage
    processes of a 2-stage split against one stage holding every layer, over what the same
    process holds with no model at all (a 112 MiB checkpoint, large enough to tell)."""
    model = write_checkpoint(tmp_path / "small", "small", "qwen3")
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    floor = subprocess.run(
        [sys.executable, "-c", "import mlxcel.pipeline.remote, mlxcel.serving.runner, mlx.core as mx; "
         "mx.eval(mx.zeros(1)); import os; print(open(f'/proc/{os.getpid()}/status').read())"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=True,
    ).stdout  # fmt: skip
    base = next(int(x.split()[1]) * 1024 for x in floor.splitlines() if x.startswith("VmRSS:"))
    held: dict[int, list[int]] = {}
    for n in (1, 2):
        (tmp_path / f"pp{n}").mkdir()
        async with LoopbackCluster(model, n, tmp_path / f"pp{n}", spawn_coordinator=False) as cl:
            held[n] = [_rss(p.pid) - base for _, p, _ in cl.procs]
    (whole,) = held[1]
    print(f"weights {weights >> 20} MiB; over a bare process: one stage {whole >> 20} MiB, "
          f"two stages {[h >> 20 for h in held[2]]} MiB")  # fmt: skip
    assert whole > 0.9 * weights
    for h in held[2]:  # each holds well under the whole: its layers, not the model
        assert h < 0.75 * whole, (held, weights)


def test_the_cli_offers_every_family_the_checkpoint_writer_has() -> None:
    from typing import get_args

    from mlxcel.config.tools import Family

    assert set(get_args(Family)) == set(FAMILIES)


def test_tp_checks_follow_what_each_familys_shard_splits(family_models: dict[str, Path]) -> None:
    def cfg(family: str) -> dict[str, Any]:
        return json.loads((family_models[family] / "config.json").read_text())

    # Qwen 3.5 repeats key/value heads when there are fewer than ranks (mlx-lm does).
    q35 = cfg("qwen3_5")
    q35["text_config"]["num_key_value_heads"] = 1
    check_shardable(q35, 2)
    q35["text_config"]["num_key_value_heads"] = 3
    with pytest.raises(
        ConfigError, match="key/value heads 3 neither divide nor are divisible by 2"
    ):
        check_shardable(q35, 2)
    # A quantized checkpoint splits its scales with the weights: whole groups per rank.
    oss = cfg("gpt_oss")
    oss.update(num_attention_heads=8, num_key_value_heads=4, intermediate_size=2880)
    oss["quantization"] = {"group_size": 32, "bits": 4}
    with pytest.raises(ConfigError, match="2880 / 4 = 720 is not a whole number of 32-wide"):
        check_shardable(oss, 4)
    check_shardable(oss, 2)  # 1440 = 45 groups
    # Qwen3-MoE's dense layers (mlp_only_layers) split the dense MLP width too.
    moe = cfg("qwen3_moe")
    moe.update(mlp_only_layers=[0], intermediate_size=130)
    with pytest.raises(ConfigError, match="MLP intermediate size 130 not divisible by 4"):
        check_shardable(moe, 4)


def test_layers_are_priced_under_every_checkpoint_naming(tmp_path: Path) -> None:
    """Hugging Face's multimodal naming (model.language_model.layers.N), mlx-lm's
    (language_model.model.layers.N), multi-token-prediction and vision tensors (dropped)."""
    import mlx.core as mx

    from mlxcel.pipeline.partition import layer_costs

    w = {
        "model.language_model.embed_tokens.weight": mx.zeros((10, 4)),
        "model.language_model.layers.0.mlp.weight": mx.zeros((8, 4)),
        "model.language_model.layers.1.mlp.switch_mlp.weight": mx.zeros((4, 8, 4)),
        "model.language_model.norm.weight": mx.zeros((4,)),
        "lm_head.weight": mx.zeros((10, 4)),
        "mtp.layers.0.weight": mx.zeros((100, 4)),
        "model.visual.blocks.0.weight": mx.zeros((100, 4)),
    }
    mx.save_safetensors(str(tmp_path / "model.safetensors"), w)
    cfg = {"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 2, "num_experts": 4,
           "num_experts_per_tok": 1, "tie_word_embeddings": False}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = layer_costs(tmp_path)
    assert c.layers == (128, 512) and c.active == (128, 128)
    assert (c.embed, c.head, c.other) == (160, 176, 0)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--pp-layers", "0-1,3-3"), "--pp-layers: range 3-3 should start at layer 2"),
        (("--pp-layers", "a-b"), "--pp-layers: bad range 'a-b'"),
        (("--pp-size", "9"), "--pp-size 9: cannot split 4 layers into 9 stages"),
        (("--pp-size", "3", "--pp-layers", "0-1,2-3"), "--pp-size 3 but --pp-layers lists 2"),
        (("--pp-layers", " "), "--pp-layers"),
    ],
)
def test_a_bad_split_is_refused_before_any_weight_loads(
    family_models: dict[str, Path], extra: tuple[str, ...], message: str
) -> None:
    r = _generate(family_models["qwen3_moe"], *extra)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr and "loaded model" not in r.stderr
    assert "Traceback" not in r.stderr


def test_a_dry_run_plans_every_family_and_refuses_a_broken_config(
    family_models: dict[str, Path], tmp_path: Path
) -> None:
    for family in ("qwen3_5", "kimi_k3"):  # the decoder's fields under text_config
        r = _generate(family_models[family], "--pp-size", "2", "--dry-run")
        assert r.returncode == 0, r.stderr[-2000:]
        assert "stage     layers" in r.stdout and "0-" in r.stdout
    for name, body, message in (
        ("list", "[1, 2]", "not a JSON object but a list"),
        ("json", "{not json", "config.json"),
        ("no-type", json.dumps({"num_hidden_layers": 4}), "names no model_type"),
        ("layers", json.dumps({"model_type": "qwen3", "num_hidden_layers": -3}),
         "num_hidden_layers must be a positive integer, not -3"),
        ("olmo", json.dumps({"model_type": "olmo3", "num_hidden_layers": 4}),
         "family 'olmo3' has no layer-range executor"),
    ):  # fmt: skip
        model = tmp_path / name
        model.mkdir()
        for f in family_models["qwen3"].iterdir():
            (model / f.name).write_bytes(f.read_bytes())
        (model / "config.json").write_text(body)
        for extra in (("--dry-run",), ()):
            r = _generate(model, "--pp-size", "2", *extra)
            assert r.returncode != 0 and message in r.stderr, (name, extra, r.stderr[-1500:])
            assert "Traceback" not in r.stderr
