"""Machines as numbers: hardware profiles (peak FLOP/s per dtype, memory bandwidth, capacity), where measured
profiles are stored, measuring this machine with torch (imported lazily, inside `measure`), and which compute dtype
`auto` means here and the torch dtype of each number format; the decode ceilings measured at a model's shapes
(kept beside the profiles).

May import: core.
"""
