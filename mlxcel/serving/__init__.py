"""Serving and embedding: a spec of plain values, assembled by the mode registry into a Stack,
run by a NodeRunner; the frontend that turns requests into entries and results into text
(prompts, tokenizer, structured output)."""
