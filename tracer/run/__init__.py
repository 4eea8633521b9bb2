"""A generation end to end: the loop (tokenize, prefill, sample, decode until EOS or the limit), sampling with
its record of what each step did, and streaming detokenization.

May import: core, hardware, checkpoint, analytic, roofline, model, load, trace.
"""
