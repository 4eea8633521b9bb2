"""A run as records: the Tracer (module hooks, fused-path marks), what each stage call costs, the frozen
records, the Trace value with its JSON form and schema, summaries derived from it, and its Chrome/Perfetto view.
The records, the Trace and its summaries need no torch (`llmtrace show` reads them without it).

May import: core, hardware, checkpoint, analytic, roofline, model, load.
"""
