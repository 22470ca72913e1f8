"""Checkpoints: save (a snapshot in memory, written to storage in the background) and restore at any world size.

One package for the whole checkpoint wing of a worker: `save` and `snapshot` write a checkpoint,
`restore` agrees on the resume point and loads it, `fetch` keeps a node's private copies, and the
resize paths (`repartition`, `repartition_zero3`, `share`, `universal`, `universal_spread`) load a
checkpoint written at another world size. Nothing is imported here: `tidal export` reads
`safe_load` from this package on a machine that never imports Ray Train or DeepSpeed's engine.
"""
