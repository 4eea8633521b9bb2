"""Costs against machines: prefill and decode bounded by compute and memory ceilings, and a measured run set
beside its bound; decode from kernels measured at decode shapes, where this machine has them. Pure Python.

May import: core, hardware, checkpoint, analytic.
"""
