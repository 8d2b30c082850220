"""The pure base every layer stands on: messages and their tensors, error codes and errors,
effects, transition tables, deadlines, defaults, the KV handoff's digest, membership lines,
what config.json says and the topology a node shows. No I/O, no third-party package."""
