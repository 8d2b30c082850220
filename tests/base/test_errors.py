"""One error hierarchy: every exception mlxcel defines lives in ``mlxcel.base.errors`` under
``MlxcelError``, and every wire error code has one HTTP answer, in ``mlxcel.base.error_codes``."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import mlxcel.base.errors as errors
from mlxcel.base.error_codes import UNAVAILABLE, ErrorCode, http_status

PKG = Path(errors.__file__).parents[1]  # the whole package


def test_every_exception_class_is_defined_in_errors_py() -> None:
    elsewhere = []
    for path in PKG.rglob("*.py"):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if any(b.endswith(("Error", "Exception")) or b in vars(errors) for b in bases):
                    elsewhere.append(f"{path.relative_to(PKG)}: {node.name}")
    assert elsewhere == []


def test_every_error_is_an_mlxcel_error_and_coded_ones_keep_their_code() -> None:
    classes = [c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, Exception)]
    assert all(issubclass(c, errors.MlxcelError) for c in classes)
    for cls in (errors.ProtocolError, errors.PipelineError, errors.EngineError):
        e = cls(ErrorCode.DRAINING, "shutting down")
        assert (
            isinstance(e, errors.CodedError) and e.code == "draining" and str(e) == "shutting down"
        )
    # The transport's failures are one family a caller can catch as such.
    for cls in (errors.FrameAuthFailed, errors.DecryptFailed, errors.PeerSilent, errors.SendFailed):
        assert issubclass(cls, errors.TransportError)
    assert issubclass(errors.HandshakeError, errors.TransportError)


def test_every_wire_code_has_one_http_answer() -> None:
    for code in ErrorCode:
        status, kind, headers = http_status(code)
        if code in UNAVAILABLE:
            assert (status, headers) == (503, {"Retry-After": "1"}), code
        elif code in (ErrorCode.DEADLINE_EXCEEDED, ErrorCode.HANDOFF_TIMEOUT):
            assert status == 504 and kind == "timeout", code
        else:
            assert status == 500 and headers is None, code
    assert http_status("a_code_from_a_newer_peer") == (500, "server_error", None)
