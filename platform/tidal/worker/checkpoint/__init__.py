"""Checkpoints: save (a snapshot in memory, written to storage in the background) and restore at any world size.

One package for the whole checkpoint wing of a worker, every module named here:
- writing: `save` (through Ray Train, with manifests and the completeness marker), `snapshot`
  (training waits only for a copy in memory; the write to storage runs in the background) over
  `host_buffers` (the reused host copies of the state dicts);
- the memory tier: `memory` (each rank's side: snapshots every few steps, the restore from
  them), `keeper` (the per-node, per-job actors that hold them, named for the job's identity),
  `segment` (the shared memory a keeper owns and its ranks write into), `flat_state` (a state
  as one block of tensor bytes and a small record) and `interval` (how often, when the job
  lets it choose);
- choosing: `route`, the one pure decision of how a checkpoint or snapshot loads;
- restoring: `restore` (agree on the resume point, convert once, load the chosen way), `damage`
  (only proven damage condemns a checkpoint), `fetch` (a node's private copies of what a rank
  loads), `safe_load` (loading never runs code), `held_files` (files in memory read as a
  filesystem);
- the resize paths that load a checkpoint written at another world size: `repartition`,
  `repartition_zero3` (by byte range), `universal`, `universal_spread` (DeepSpeed's universal
  conversion) and `share` (a ZeRO-3 rank's slice of a universal file).

Nothing is imported here: `tidal export` reads `safe_load` from this package on a machine that
never imports Ray Train or DeepSpeed's engine.
"""
