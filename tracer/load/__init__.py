"""Weights into a model: the `--model` front door, GGUF and HF-safetensors weight readers, and the cache of
converted weights.

May import: core, hardware, checkpoint, analytic, roofline, model.
"""
