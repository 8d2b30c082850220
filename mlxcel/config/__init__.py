"""Settings for every command (CLI > environment > TOML file > default): serving's, HTTP's,
mlx-lm's options, the tool commands', and the generated command lines."""
