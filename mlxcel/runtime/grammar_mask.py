"""The logits processor of structured output: each step's logits masked to the tokens
llguidance's matcher allows (see :mod:`mlxcel.serving.grammar`).

Like the other processors it runs once per sampled token. It reads the token sampled at the
previous call from the history the node passes (the last entry, whatever window precedes
it), so it needs no view of the whole sequence. The mask is applied with ``mx.where`` on any
device (llguidance's own MLX helper is a Metal kernel). A grammar the matcher cannot run (it
never passed the API's check, or the output left it) puts the matcher in its error state,
whose mask allows only the end-of-sequence tokens: that sequence ends, the batch goes on.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel.serving.grammar import matcher_for


class GrammarMask:
    def __init__(self, grammar: str, tokenizer: Any) -> None:
        self.matcher = matcher_for(grammar, tokenizer)  # compiled once per process
        self.started = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.started:  # the token sampled under the previous mask
            self.matcher.consume_token(int(tokens[-1].item()))
        self.started = True
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")
        width = logits.shape[-1]
        if allowed.size < width:  # the model's vocabulary may extend past the tokenizer's
            allowed = np.pad(allowed, (0, width - allowed.size))
        return mx.where(mx.array(allowed[:width].astype(np.bool_)), logits, -mx.inf)
