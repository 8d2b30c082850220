"""A tiny checkpoint rigged so greedy decoding follows known token chains.

Every layer's output projections are zeroed, so the residual stream at a position is that
position's own embedding and the next token depends on the current token alone (a bigram
model). Chain tokens get one-hot embeddings and the LM head scores each chain's successor;
everything else keeps its random weights. Real formats, real tokenizer, real runtime: only
the weights are chosen, which lets tests check what a parameter does to the output.

Chains (the ids are in the returned :class:`Rigged`):

- the chat template's generation prompt ends in ``nl``; then ``<tool_call>`` → a JSON call
  (one added token) → ``</tool_call>`` → ``<|im_end|>``: a tool call, then the end;
- ``x`` → ``x`` with logit 1.0 and ``x`` → ``y`` with logit 0.5: greedy repeats ``x``; any
  penalty on repeats tips it over to ``y``; ``y`` → ``z`` (logit 1.0) → ``z`` ...
- ``w`` → the byte 0xC3 → the byte 0xA9 → ``<|im_end|>``: "é" split over two tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
VOCAB = 520  # 512 trained + 3 added tokens, padded


@dataclass(frozen=True)
class Rigged:
    path: Path
    nl: int  # the generation prompt's last token
    call_start: int
    call: int
    call_end: int
    eos: int
    x: int
    y: int
    z: int
    w: int
    e_lead: int  # the byte 0xC3 (byte-level BPE shows it as "Ã")
    e_tail: int  # the byte 0xA9 ("©")


def write_rigged(out: Path) -> Rigged:
    import mlx.core as mx
    from tokenizers import AddedToken, Tokenizer

    from mlxcel.runtime.checkpoint import write_checkpoint

    write_checkpoint(out, "tiny")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, normalized=False) for t in ("<tool_call>", "</tool_call>", CALL)])
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>", CALL, "<|im_end|>")}
    x, y, z, w_tok = (tok.token_to_id(c) for c in "xyzw")
    e_lead, e_tail = tok.token_to_id("\u00c3"), tok.token_to_id("\u00a9")
    gen_prompt = tok.encode("<|im_start|>assistant\n").ids
    nl = gen_prompt[-1]
    assert tok.decode([nl]).endswith("\n"), tok.decode([nl])

    cfg = json.loads((out / "config.json").read_text())
    cfg["vocab_size"] = VOCAB
    cfg["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg, indent=2))

    w = mx.load(str(out / "model.safetensors"))
    hidden = cfg["hidden_size"]
    emb = mx.concatenate([w["model.embed_tokens.weight"], mx.zeros((VOCAB - 512, hidden))])
    for k in list(w):
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            w[k] = mx.zeros_like(w[k])
    w["model.norm.weight"] = mx.ones((hidden,))
    head = mx.zeros((VOCAB, hidden))
    # After the final RMSNorm a one-hot embedding is sqrt(hidden) in its dimension, so a head
    # row of (logit / sqrt(hidden)) there scores that successor with ``logit``.
    scale = hidden**-0.5
    chain = [
        (nl, ids["<tool_call>"], 10.0),
        (ids["<tool_call>"], ids[CALL], 10.0),
        (ids[CALL], ids["</tool_call>"], 10.0),
        (ids["</tool_call>"], ids["<|im_end|>"], 10.0),
        (x, x, 1.0),
        (x, y, 0.5),
        (y, z, 1.0),
        (z, z, 1.0),
        (w_tok, e_lead, 10.0),
        (e_lead, e_tail, 10.0),
        (e_tail, ids["<|im_end|>"], 10.0),
    ]
    sources = list(dict.fromkeys(src for src, _, _ in chain))
    dim = {src: i for i, src in enumerate(sources)}
    for src in sources:
        emb[src] = mx.zeros((hidden,))
        emb[src, dim[src]] = 1.0
    for src, dst, logit in chain:
        head[dst, dim[src]] = logit * scale
    w["model.embed_tokens.weight"] = emb
    w["lm_head.weight"] = head
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"]["lm_head.weight"] = "model.safetensors"
        index.write_text(json.dumps(data, indent=2))
    return Rigged(
        out,
        nl,
        ids["<tool_call>"],
        ids[CALL],
        ids["</tool_call>"],
        ids["<|im_end|>"],
        x,
        y,
        z,
        w_tok,
        e_lead,
        e_tail,
    )
