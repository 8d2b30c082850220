from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from mlxcel.base.errors import ConfigError, PlatformUnsupported
from mlxcel.cli import main as cli_main
from mlxcel.config.cli import load_settings
from mlxcel.config.settings import GenerateSettings, ServeSettings
from mlxcel.process.platform_guard import refuse_distributed_on_windows
from tests.conftest import error_line

ROOT = Path(__file__).resolve().parents[2]


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        cwd=ROOT,
        input=stdin,
    )


def _ns(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**kw)


def test_precedence_cli_over_env_over_file_over_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "mlxcel.toml"
    toml.write_text("port = 7000\nparallel = 3\nqueue_size = 5\n")
    monkeypatch.setenv("MLXCEL_PARALLEL", "4")
    monkeypatch.setenv("MLXCEL_QUEUE_SIZE", "6")
    s = load_settings(ServeSettings, _ns(_config=str(toml), queue_size="7"))
    assert s.port == 7000  # file beats default
    assert s.parallel == 4  # env beats file
    assert s.queue_size == 7  # CLI beats env
    assert s.host == "127.0.0.1"  # default
    monkeypatch.setenv("MLXCEL_CONFIG", str(toml))
    monkeypatch.delenv("MLXCEL_PARALLEL")
    assert load_settings(ServeSettings, _ns()).parallel == 3


def test_invalid_values_name_flag_and_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"^--parallel: .*greater than or equal to 1"):
        load_settings(ServeSettings, _ns(parallel="0"))
    monkeypatch.setenv("MLXCEL_PORT", "99999")
    with pytest.raises(ConfigError, match=r"^--port \(from MLXCEL_PORT\)"):
        load_settings(ServeSettings, _ns())
    monkeypatch.delenv("MLXCEL_PORT")
    bad = tmp_path / "bad.toml"
    bad.write_text("temp = 'hot'\n")
    with pytest.raises(ConfigError, match=r"^--temp \(from .*bad.toml\)"):
        load_settings(GenerateSettings, _ns(_config=str(bad)))
    bad.write_text("no_such_setting = 1\n")
    with pytest.raises(ConfigError, match="unknown setting"):
        load_settings(GenerateSettings, _ns(_config=str(bad)))
    bad.write_text("this is [not toml\n")
    with pytest.raises(ConfigError, match="--config"):
        load_settings(GenerateSettings, _ns(_config=str(bad)))
    with pytest.raises(ConfigError, match="no such model folder"):
        load_settings(GenerateSettings, _ns(model=str(tmp_path / "missing")))


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["generate", "--top-p", "2"], "--top-p"),
        (["serve", "--port", "x"], "--port"),
        (["generate", "--nope"], "unrecognized"),
        (["checkpoint"], "--out"),
        (["serve", "--log-level", "LOUD"], "--log-level"),
        # A flag of a mode the command does not run is refused, not ignored.
        (["serve", "--pp-return-logits"], "--pp-return-logits"),
        (["serve", "--pp-micro-batch-size", "2"], "--pp-micro-batch-size"),
        (["serve", "--node-id", "x"], "--node-id"),
        (["generate", "--pp-return-logits"], "--pp-return-logits"),
        (["generate", "--max-batch-size", "2"], "unrecognized"),
        (["bench", "batching", "--max-batch-size", "2"], "unrecognized"),
    ],
)
def test_invalid_flag_exits_2_with_one_line(args: list[str], flag: str) -> None:
    r = run_cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], r.stderr


def test_help_lists_every_flag_readably() -> None:
    r = run_cli("serve", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for name, f in ServeSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        shown = f"default: {f.default}" in text
        says_nothing = f.default is None or f.default is False or "default" in (f.description or "")
        assert shown != says_nothing, name  # a default that says something, and only once
    assert (
        "MLXCEL_PARALLEL" in text and "(default: None" not in text and "default: None" not in text
    )
    assert "--node-role {hybrid,prefill,decode,router}" in text
    assert "--log-level {TRACE,DEBUG,INFO,WARNING,ERROR}" in text
    for group in ("model and prompt:", "HTTP server:", "pipeline parallelism:", "logging and"):
        assert group in r.stdout, group
    gen = run_cli("generate", "--help").stdout
    usage = " ".join(gen.split("\n\n")[0].split())
    # The common flags first: -m, -p, -n before any --pp-/--tp- flag.
    assert usage.index("-m MODEL") < usage.index("-p PROMPT") < usage.index("-n MAX_TOKENS")
    assert usage.index("-n MAX_TOKENS") < usage.index("--pp-") < usage.index("--tp-")
    ck = run_cli("checkpoint", "--help").stdout
    flat = " ".join(ck.split())
    assert "required: --out OUT output folder [required" in flat
    for choices in (
        "--shape {tiny,small,qwen3-0.6b,qwen3-8b,qwen3-14b,qwen3-30b-a3b}",
        "--family {qwen3,qwen2,llama,mistral,qwen3_moe,qwen3_5,qwen3_5_moe,gemma3_text,deepseek_v3,kimi_k2,kimi_k3,glm4_moe,gpt_oss,mixtral,phi3}",
    ):
        assert choices in flat
    assert "--quantize {4,8}" in flat
    # Each benchmark documents the default model it actually uses.
    for bench, shape in (
        ("batching", "small"),
        ("pipeline", "small"),
        ("tp", "small"),
        ("disagg", "small"),
        ("bringup", "tiny"),
    ):
        h = " ".join(run_cli("bench", bench, "--help").stdout.split())
        assert f"default: the embedded {shape}" in h, bench
    # A benchmark takes only the flags it uses.
    assert "--tp-size" not in run_cli("bench", "batching", "--help").stdout


def test_log_level_is_case_insensitive(tiny: Path) -> None:
    base = ("generate", "-m", str(tiny), "-p", "x", "-n", "2")
    r = run_cli(*base, "--log-level", "warning")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = run_cli(*base, env={"MLXCEL_LOG_LEVEL": "warning"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = run_cli(*base, "--log-level", "info")
    assert r.returncode == 0 and " INFO    BLAS: " in r.stderr, r.stderr


def test_one_toml_file_serves_every_command(tmp_path: Path) -> None:
    conf = tmp_path / "mlxcel.toml"
    conf.write_text(
        "port = 7001\nmax_tokens = 7\nstreams = '1,2'\n"
        "[serve]\nparallel = 2\n[generate]\nmax_tokens = 9\n[bench.batching]\ntokens = 5\n"
    )
    args = cli_main.build_parser().parse_args(["serve", "--config", str(conf)])
    kw: dict[str, typing.Any] = {"section": "serve", "sections": cli_main.SECTIONS}
    serve = load_settings(ServeSettings, args, **kw)
    assert serve.port == 7001 and serve.parallel == 2
    assert any("max_tokens" in n and "streams" in n for n in serve.notes)
    gen = load_settings(GenerateSettings, _ns(_config=str(conf)), **{**kw, "section": "generate"})
    assert gen.max_tokens == 9  # its table beats the top level
    from mlxcel.config.tools import BenchBatchingSettings

    bench = load_settings(
        BenchBatchingSettings, _ns(_config=str(conf)), **{**kw, "section": "bench.batching"}
    )
    assert bench.tokens == 5 and bench.streams == "1,2"
    # Through the real command line: the note is logged, nothing fails.
    r = run_cli("checkpoint", "--config", str(conf), "--out", str(tmp_path / "ck"))
    assert r.returncode == 0 and "note:" in r.stderr and "ignores other commands" in r.stderr
    conf.write_text("[serve]\nmax_tokens = 3\n")
    with pytest.raises(ConfigError, match=r"\[serve\] has setting\(s\) serve lacks: max_tokens"):
        load_settings(ServeSettings, args, **kw)
    conf.write_text("frobnicate = 1\n")
    with pytest.raises(ConfigError, match="unknown setting.*frobnicate"):
        load_settings(ServeSettings, args, **kw)
    # Another command's table is checked too: a typo fails whichever command reads the file.
    for text, words in (
        ("[generate]\nbogus = 1\n", "[generate] has setting(s) generate lacks: bogus"),
        ("[bench.batchng]\ntokens = 3\n", "no command [bench.batchng]"),
        ("bench = 'x'\n", "[bench] must hold"),
        ("generate = [1, 2]\n", "[generate] must be a table"),
        ("[bench]\nstreams = '1'\n", "no command [bench.streams]"),
    ):
        conf.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_settings(ServeSettings, args, **kw)


def test_generate_prints_text_and_a_stats_line(tiny: Path) -> None:
    r = run_cli("generate", "-m", str(tiny), "-p", "Hello there", "-n", "12", "--temp", "0")
    assert r.returncode == 0, r.stderr
    *text, stats = r.stdout.rstrip("\n").split("\n")
    assert "".join(text)
    assert stats.startswith("prompt tokens: ") and "generated tokens: 12" in stats
    assert "prefill:" in stats and "decode:" in stats and "tok/s" in stats
    assert "BLAS:" in r.stderr
    again = run_cli("generate", "-m", str(tiny), "-p", "Hello there", "-n", "12", "--temp", "0")
    assert again.stdout.split("\n")[:-2] == r.stdout.split("\n")[:-2]  # greedy is deterministic


def _prompt_tokens(r: subprocess.CompletedProcess[str]) -> int:
    assert r.returncode == 0, r.stderr
    return int(r.stdout.rstrip("\n").split("\n")[-1].split("prompt tokens: ")[1].split(",")[0])


def test_generate_uses_the_chat_template_like_mlx_lm(tiny: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tiny)
    base = ("generate", "-m", str(tiny), "-n", "3", "--temp", "0")
    raw = _prompt_tokens(run_cli(*base, "-p", "Hello there", "--raw"))
    assert raw == len(tok.encode("Hello there"))
    chat = _prompt_tokens(run_cli(*base, "-p", "Hello there"))
    want = tok.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True
    )
    assert chat == len(want) > raw
    system = _prompt_tokens(run_cli(*base, "-p", "Hello there", "--system-prompt", "Be brief."))
    assert system > chat
    # -p - reads the prompt from stdin: the same tokens, the same text.
    piped = run_cli(*base, "-p", "-", stdin="Hello there")
    direct = run_cli(*base, "-p", "Hello there")
    assert (
        _prompt_tokens(piped) == chat
        and piped.stdout.split("\n")[0] == direct.stdout.split("\n")[0]
    )
    empty = run_cli(*base, "-p", "-", stdin="")
    assert empty.returncode == 2 and "empty prompt from stdin" in empty.stderr
    assert "loaded model" not in empty.stderr  # refused before the model loads
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", *base, "-p", "-"],
        input=b"\xff\xfe",
        capture_output=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 2 and b"not UTF-8" in r.stderr
    assert run_cli(*base, "-p", "", "--raw").returncode == 2
    assert run_cli("generate", "-m", "", "-p", "x").returncode == 2
    both = run_cli(*base, "--raw", "--system-prompt", "x")
    assert both.returncode == 2 and "--system-prompt needs the chat template" in both.stderr


def test_embedded_default_is_created_once_and_reused(tmp_path: Path) -> None:
    env = {"MLXCEL_HOME": str(tmp_path)}
    first = run_cli("generate", "-p", "hi", "-n", "3", env=env)
    assert first.returncode == 0, first.stderr
    model = tmp_path / "models" / "tiny-qwen3-s0"
    assert (model / "config.json").is_file()
    stamp = (model / "model.safetensors").stat().st_mtime_ns
    second = run_cli("generate", "-p", "hi", "-n", "3", env=env)
    assert second.returncode == 0
    assert (model / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.stdout == second.stdout.replace(
        second.stdout.splitlines()[-1], first.stdout.splitlines()[-1]
    )


def test_checkpoint_command_writes_a_loadable_model(tmp_path: Path) -> None:
    out = tmp_path / "ck"
    r = run_cli(
        "checkpoint", "--shape", "tiny", "--family", "llama", "--out", str(out), "--seed", "5"
    )
    assert r.returncode == 0, r.stderr
    assert f"checkpoint: ready at {out}" in r.stderr
    g = run_cli("generate", "-m", str(out), "-n", "3")
    assert g.returncode == 0 and "generated tokens: 3" in g.stdout


def test_windows_refuses_distributed_flags_before_resolving_the_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(PlatformUnsupported, match="--tp-size"):
        refuse_distributed_on_windows("generate", {"tp_size": "2"}, platform="win32")
    refuse_distributed_on_windows("generate", {"tp_size": "2"}, platform="linux")
    refuse_distributed_on_windows("generate", {"tp_size": "1"}, platform="win32")

    resolved: list[str] = []
    monkeypatch.setattr("mlxcel.process.home.embedded_model", lambda *a, **k: resolved.append("x"))
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setenv("MLXCEL_HOME", str(tmp_path))
    for argv, flag in (
        (["generate", "--pp-size", "2"], "--pp-size"),
        (["serve", "--tp-size", "4", "-m", "/does/not/exist"], "--tp-size"),
        (["serve", "--pp-auto", "2", "--cluster-peers", "127.0.0.2:1,127.0.0.3:1"], "--pp-auto"),
        (["serve", "--pp-peer", "--cluster-control-addr", "127.0.0.2:19001"], "--pp-peer"),
        (["serve", "--node-role", "decode", "--serving-bind", "127.0.0.2:1"], "--node-role"),
        (["serve", "--cluster-peers", "127.0.0.2:1"], "--cluster-peers"),
        (["serve", "--prefill-peers", "127.0.0.2:1"], "--prefill-peers"),
        (["serve", "--decode-peers", "127.0.0.2:1"], "--decode-peers"),
        (["serve", "--serving-bind", "127.0.0.2:1"], "--serving-bind"),
    ):
        with pytest.raises(SystemExit) as info:
            cli_main.main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and "Windows" in err
    # hybrid is the single-node default: not a distributed mode.
    refuse_distributed_on_windows("serve", {"node_role": "hybrid"}, platform="win32")
    monkeypatch.setenv("MLXCEL_TP_SIZE", "2")
    with pytest.raises(SystemExit):
        cli_main.main(["generate"])
    assert "--tp-size" in capsys.readouterr().err
    monkeypatch.delenv("MLXCEL_TP_SIZE")
    monkeypatch.setenv("MLXCEL_NODE_ROLE", "router")
    with pytest.raises(SystemExit):
        cli_main.main(["serve"])
    assert "--node-role" in capsys.readouterr().err
    monkeypatch.delenv("MLXCEL_NODE_ROLE")
    assert resolved == [] and not any(tmp_path.iterdir())
    # The same from a config file, given by flag or by MLXCEL_CONFIG.
    conf = tmp_path.parent / f"{tmp_path.name}-windows.toml"
    conf.write_text(
        '[serve]\nnode_role = "router"\nserving_bind = "127.0.0.2:1"\n'
        'prefill_peers = "127.0.0.3:1"\ndecode_peers = "127.0.0.4:1"\n'
    )
    with pytest.raises(SystemExit) as info:
        cli_main.main(["serve", "--config", str(conf)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--node-role" in err and "Windows" in err, err
    conf.write_text("[serve]\ntp_size = 2\n")
    monkeypatch.setenv("MLXCEL_CONFIG", str(conf))
    with pytest.raises(SystemExit) as info:
        cli_main.main(["serve"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--tp-size" in err and "Windows" in err, err
    assert resolved == []


def test_embedding_example_runs() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed_node.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert "ticks while generating:" in r.stdout
    assert "handler errors counted: 1" in r.stdout
    assert "served over HTTP: 4 tokens; first token's alternatives: 2" in r.stdout
    assert "one more: 4 tokens; ready: True" in r.stdout  # the Stack verbs, start to close


def _literal_choices(annotation: object) -> tuple[object, ...]:
    """The values of every Literal inside ``annotation`` (``Literal[4, 8] | None`` included)."""
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return tuple(v for a in typing.get_args(annotation) for v in _literal_choices(a))


# The least each command needs besides the setting under test.
_REQUIRED: dict[str, list[str]] = {
    "checkpoint": ["--out", "/tmp/x"],
    "keygen": ["--out", "/tmp/x"],
    "cluster-check": ["--listen", "127.0.0.1:1"],
}


# A choice that needs other flags to be valid.
_COMPANIONS: dict[tuple[str, object], list[str]] = {
    ("node_role", "prefill"): ["--serving-bind", "127.0.0.1:9"],
    ("node_role", "decode"): ["--serving-bind", "127.0.0.1:9"],
    ("node_role", "router"): [
        "--serving-bind",
        "127.0.0.1:9",
        "--prefill-peers",
        "127.0.0.2:9",
        "--decode-peers",
        "127.0.0.3:9",
    ],
}


def _every_literal_setting() -> list[tuple[list[str], str, object]]:
    cases = []
    commands = [([name], cls) for name, (cls, _) in cli_main.COMMANDS.items()]
    commands += [(["bench", name], cls) for name, (cls, _) in cli_main.BENCHES.items()]
    for words, cls in commands:
        for field, info in cls.model_fields.items():
            for value in _literal_choices(info.annotation):
                cases.append((words, field, value))
    return cases


@pytest.mark.parametrize(("words", "field", "value"), _every_literal_setting())
def test_every_documented_choice_is_accepted_from_cli_and_environment(
    words: list[str], field: str, value: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Choices reach the model as text from both places (``--quantize 4`` was refused once)."""
    cls = (cli_main.BENCHES if words[0] == "bench" else cli_main.COMMANDS)[words[-1]][0]
    flag = "--" + field.replace("_", "-")
    base = [*words, *_REQUIRED.get(words[-1], []), *_COMPANIONS.get((field, value), [])]
    args = cli_main.build_parser().parse_args([*base, flag, str(value)])
    assert getattr(load_settings(cls, args), field) == value
    monkeypatch.setenv("MLXCEL_" + field.upper(), str(value))
    assert getattr(load_settings(cls, cli_main.build_parser().parse_args(base)), field) == value


def test_checkpoint_quantize_through_the_cli(tmp_path: Path) -> None:
    for bits, how in ((4, "flag"), (8, "env")):
        out = tmp_path / f"q{bits}"
        args = ["checkpoint", "--out", str(out)]
        env = {"MLXCEL_QUANTIZE": str(bits)} if how == "env" else None
        r = run_cli(*args, *(["--quantize", str(bits)] if how == "flag" else []), env=env)
        assert r.returncode == 0, r.stderr
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["quantization"]["bits"] == bits
    r = run_cli("checkpoint", "--out", str(tmp_path / "bad"), "--quantize", "3")
    assert r.returncode == 2 and "--quantize" in r.stderr


def test_busy_http_port_is_one_line_naming_the_address(tiny: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("serve", "-m", str(tiny), "--port", str(port))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    line = error_line(r.stderr)
    assert f"127.0.0.1:{port}" in line and "address already in use" in line


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["--node-role", "decode", "--serving-bind", "0.0.0.0:9"],
            "--serving-bind 0.0.0.0:9: this address is the node's identity",
        ),
        (["--node-role", "decode"], "needs --serving-bind"),
        (["--node-role", "router", "--serving-bind", "127.0.0.1:9"], "needs --prefill-peers"),
        (
            [
                "--node-role",
                "router",
                "--serving-bind",
                "127.0.0.1:9",
                "--prefill-peers",
                "127.0.0.2:9",
                "--decode-peers",
                "127.0.0.2:9",
            ],
            "listed in both",
        ),
        (["--node-role", "prefill", "--serving-bind", "host:9"], "literal IP"),
        (["--prefill-peers", "127.0.0.2:9"], "needs --node-role"),
        (
            [
                "--node-role",
                "decode",
                "--serving-bind",
                "127.0.0.1:9",
                "--decode-peers",
                "127.0.0.2:9",
            ],
            "for --node-role router or prefill",
        ),
    ],
)
def test_disaggregated_flags_are_checked_before_anything_starts(
    argv: list[str], needle: str
) -> None:
    r = run_cli("serve", *argv)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def _fake_hub_cache(root: Path, repo: str, model: Path) -> Path:
    """The Hugging Face cache layout (refs/main -> snapshots/<commit>/files), offline."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    shutil.copytree(model, base / "snapshots" / commit)
    return base / "snapshots" / commit


def test_a_hub_id_loads_from_the_offline_cache(
    tiny: Path, tmp_path: Path, start_server: type
) -> None:
    import openai

    cache = tmp_path / "hub"
    snap = _fake_hub_cache(cache, "mlxcel-test/tiny-chat", tiny)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    r = run_cli("generate", "-m", "mlxcel-test/tiny-chat", "-p", "hi", "-n", "4", env=env)
    assert r.returncode == 0, r.stderr
    assert "generated tokens: 4" in r.stdout
    assert f"loaded model {snap}" in r.stderr and "MiB of weights" in r.stderr
    local = run_cli("generate", "-m", str(tiny), "-p", "hi", "-n", "4")
    assert r.stdout.split("\n")[0] == local.stdout.split("\n")[0]  # the same checkpoint
    # Not in the cache, offline: one line naming the id and the cache, exit 2.
    missing = run_cli("generate", "-m", "mlxcel-test/absent", "-p", "hi", env=env)
    assert missing.returncode == 2
    assert "mlxcel-test/absent" in missing.stderr and str(cache) in missing.stderr
    assert "Traceback" not in missing.stderr
    # Neither a folder nor an org/name id: refused before anything loads.
    bad = run_cli("generate", "-m", "no/such/folder", "-p", "hi", env=env)
    assert bad.returncode == 2 and "no such model folder" in bad.stderr
    # serve names the model by its Hub id, which models.retrieve accepts (a '/' in the path).
    srv = start_server(["-m", "mlxcel-test/tiny-chat"], env=env)
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert [m.id for m in c.models.list().data] == ["mlxcel-test/tiny-chat"]
    assert c.models.retrieve("mlxcel-test/tiny-chat").id == "mlxcel-test/tiny-chat"


def test_checkpoint_never_overwrites_by_surprise(tmp_path: Path) -> None:
    target = tmp_path / "ck"
    assert run_cli("checkpoint", "--out", str(target)).returncode == 0
    before = (target / "model.safetensors").read_bytes()
    again = run_cli("checkpoint", "--out", str(target), "--seed", "9")
    assert again.returncode == 2 and "is not empty (--force" in again.stderr
    assert (target / "model.safetensors").read_bytes() == before
    assert run_cli("checkpoint", "--out", str(target), "--seed", "9", "--force").returncode == 0
    assert (target / "model.safetensors").read_bytes() != before
    afile = tmp_path / "file"
    afile.write_text("x")
    r = run_cli("checkpoint", "--out", str(afile))
    assert r.returncode == 2 and "is a file" in r.stderr and "Traceback" not in r.stderr


def test_an_unknown_flag_gets_the_closest_one_and_where_the_flags_are() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", "serve", "--tensor-paralel-size", "2", "--zzz"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "error: mlxcel: unrecognized arguments: --tensor-paralel-size 2 --zzz; "
        "--tensor-paralel-size: did you mean --tensor-parallel-size?; see `mlxcel serve --help`"
    )
    r = subprocess.run([sys.executable, "-m", "mlxcel", "bench", "pipeline", "--pinn"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "--pinn: did you mean --pin?; see `mlxcel bench pipeline --help`" in r.stderr


def test_vllms_parallel_size_flags_are_the_same_settings() -> None:
    from mlxcel.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--tensor-parallel-size", "2"])
    assert args.tp_size == "2"
    args = parser.parse_args(["generate", "--pipeline-parallel-size", "3"])
    assert args.pp_size == "3"
