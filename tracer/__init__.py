"""llmtrace's engine (installed as `llmtrace.tracer`): configs, analytical estimates, a traceable LLaMA, and records.

One sub-package per layer; a module imports only from its own layer or the layers below it (tests/test_architecture.py
checks every import, lazy ones included):

    run          generation loop, sampling, detokenization
    trace        Tracer, stage costs, records, Trace + JSON, summaries, Chrome trace
    load         --model -> weights in a model; GGUF / safetensors readers; weights cache
    model        the torch transformer: staged modules and fused path, RoPE, KV cache
    roofline     costs against a machine's ceilings; a run beside its bound
    analytic     FLOP formulas, estimates, parameters, KV sizes, catalogue, tensor parallelism
    checkpoint   headers, --model classification, tokenizers (no tensor data, no torch)
    hardware     hardware profiles, their store, measuring this machine, the `auto` dtype
    core         errors, ModelConfig, number formats, presets

Nothing here prints, parses command lines or imports rich/typer: the CLI (`llmtrace.cli`) renders what this returns.
Importing a package stays light (no torch): modules that need torch import it themselves.
"""
