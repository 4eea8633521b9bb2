"""What a checkpoint on disk is, read from headers only (never tensor data, never torch): GGUF and safetensors
headers, what a `--model` argument names (the one resolver every command uses), what a checkpoint holds, the
bundled model's location, tokenizers and prompt-token counts.

May import: core, hardware.
"""
