"""The prompt cache's tenants: each API key (and each ``cache_salt``) sees only its own cached
prefixes. A probe from another tenant reuses nothing (``cached_tokens`` 0), so neither the
usage nor the time to first token tells it what someone else sent."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from mlxcel.base.errors import ConfigError
from mlxcel.base.prefix_index import OPEN_NAMESPACE, cache_namespace, tenant_of
from mlxcel.server.access import parse_api_keys
from tests.cli.test_cli import run_cli
from tests.conftest import ServerProcess, error_line

HISTORY = [
    {"role": "system", "content": "You are a careful assistant for pipeline operators."},
    {"role": "user", "content": "My stages are on three hosts. Which activations cross?"},
]


def cached(c: openai.OpenAI, salt: str | None = None) -> int:
    """Send the shared history once; the cached tokens its usage reports."""
    extra = {"cache_salt": salt} if salt is not None else None
    r = c.chat.completions.create(
        model="tiny-qwen3", messages=HISTORY, max_tokens=4, temperature=0, extra_body=extra
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return int(r.usage.prompt_tokens_details.cached_tokens or 0)


def client(srv: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_each_key_and_each_salt_is_its_own_cache(
    tiny: Path, start_server: type[ServerProcess], tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nkey-carol\n\nkey-dave\n")
    srv = start_server(
        ["-m", str(tiny), "--prompt-cache-bytes", "32MiB", "--api-key-file", str(keys)],
        env={"MLXCEL_API_KEY": "key-alice,key-bob"},
    )
    alice, bob, carol = (client(srv, k) for k in ("key-alice", "key-bob", "key-carol"))
    assert cached(alice) == 0
    assert cached(alice) > 0  # alice's own history: reused
    assert cached(bob) == 0  # the same prompt from another key: nothing of alice's
    assert cached(carol) == 0  # a key from the file is a tenant too
    assert cached(alice, salt="s1") == 0  # a salt is a namespace of its own
    assert cached(alice, salt="s2") == 0
    assert cached(alice, salt="s1") > 0
    assert cached(bob, salt="s1") == 0  # the same salt under another key shares nothing
    with pytest.raises(openai.AuthenticationError):
        cached(client(srv, "key-mallory"))
    # A bad salt: 400 naming the field, and the server serves on.
    for salt, needle in ((7, "valid string"), ("x" * 257, "at most 256 bytes")):
        with pytest.raises(openai.BadRequestError) as bad:
            cached(alice, salt=salt)  # type: ignore[arg-type]
        err = bad.value.body
        assert isinstance(err, dict) and err["param"] == "cache_salt", err
        assert needle in err["message"]
    assert cached(alice, salt="é" * 128) == 0  # 256 bytes of UTF-8: accepted
    assert "key-alice" not in srv.output and "key-carol" not in srv.output
    # `mlxcel status` in the server's own environment (its several keys) sends the first.
    r = run_cli("status", srv.base_url, env={"MLXCEL_API_KEY": "key-alice,key-bob"})
    assert r.returncode == 0, r.stderr


def test_a_shared_scope_shares_between_keys_but_not_salts(
    tiny: Path, start_server: type[ServerProcess]
) -> None:
    srv = start_server(
        ["-m", str(tiny), "--prompt-cache-scope", "shared"],
        env={"MLXCEL_API_KEY": "key-a,key-b"},
    )
    a, b = client(srv, "key-a"), client(srv, "key-b")
    assert cached(a) == 0
    assert cached(b) > 0  # one cache for every key, as the operator asked
    assert cached(b, salt="mine") == 0


def test_namespaces_are_digests_that_separate_keys_and_salts() -> None:
    assert cache_namespace("", None) == OPEN_NAMESPACE
    alice, bob = tenant_of("key-alice"), tenant_of("key-bob")
    names = {
        cache_namespace(alice, None),
        cache_namespace(bob, None),
        cache_namespace(alice, ""),
        cache_namespace(alice, "s"),
        cache_namespace(bob, "s"),
        cache_namespace("", "s"),
    }
    assert len(names) == 6 and OPEN_NAMESPACE not in names
    assert all(len(n) == 32 and "alice" not in n for n in names)
    # A salt cannot be chosen to land in another tenant's namespace by moving the separator.
    assert cache_namespace("ab", "c") != cache_namespace("a", "bc")


@pytest.mark.parametrize(
    ("text", "file_text", "flag"),
    [
        ("a,,b", None, "--api-key"),
        ("a, b c", None, "--api-key"),
        (None, "good\nbad key\n", "--api-key-file"),
    ],
)
def test_malformed_keys_are_refused_naming_the_flag(
    text: str | None, file_text: str | None, flag: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_api_keys(text, file_text)
    assert flag in str(exc.value) and "whitespace" in str(exc.value)


def test_keys_parse_in_order_without_repeats() -> None:
    assert parse_api_keys(" a , b,a", "\ufeff# c\n\nc\n  d  \nb\n") == ("a", "b", "c", "d")
    assert parse_api_keys(None, "\ufeffk1\r\nk2\r\n") == ("k1", "k2")  # a BOM, CRLF lines


def test_an_unreadable_or_empty_key_file_is_refused(tiny: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing here\n\n")
    for path, needle in ((tmp_path / "missing", "cannot read"), (empty, "holds no key")):
        r = run_cli("serve", "-m", str(tiny), "--api-key-file", str(path))
        assert r.returncode == 2 and "Traceback" not in r.stderr
        line = error_line(r.stderr)
        assert "--api-key-file" in line and needle in line
