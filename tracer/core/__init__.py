"""The vocabulary every other layer speaks: typed one-line errors, the model configuration (one frozen
dataclass from a preset, an HF config.json or a GGUF header), the model contract (every stage and tensor of the
forward pass declared once: contract.py), the number formats (one DType value type with its storage size, one alias
table, one parser; ggml's block types among them: ggml_types.py), the presets, and the plumbing of files that come
from outside (JSON into one-line errors: json_input.py; the saved measurements' versioned stores: json_store.py;
atomic writes: atomic_file.py). Pure Python.

May import: nothing from llmtrace (the standard library only).
"""
