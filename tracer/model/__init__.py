"""The LLaMA-family transformer in torch: stage modules with stable dotted names (the reference and the hook
points), the fused path and the native C step that run the same math in fewer operations (built per run by
tracer/run's backends), RoPE, the KV caches and shared numerics.

May import: core, hardware, checkpoint, analytic, roofline.
"""
