"""The LLaMA-family transformer in torch: stage modules with stable dotted names (the staged path), the fused
path that runs the same math in fewer tensor operations, RoPE, the KV cache and shared numerics.

May import: core, hardware, checkpoint, analytic, roofline.
"""
