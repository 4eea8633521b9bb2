"""What a forward pass costs, worked out from a config alone: one FLOP formula per stage, per-component
estimates, parameter counts, KV-cache sizes, the preset catalogue, the `flops` report and tensor parallelism.
Pure Python: the analytical commands answer without torch.

May import: core, hardware, checkpoint.
"""
