"""Costs against machines: prefill and decode bounded by compute and memory ceilings, and a measured run set
beside its bound. Pure Python.

May import: core, hardware, checkpoint, analytic.
"""
