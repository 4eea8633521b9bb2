"""A generation end to end: the loop (tokenize, prefill, sample, decode until EOS or the limit) on the backend chosen
for the run (select.py, backends.py), sampling with its record of what each step did, and streaming
detokenization; batched runs, the batch sweep and the measurement of a model's decode kernels it predicts from.

May import: core, hardware, checkpoint, analytic, roofline, model, load, trace.
"""
