"""Clusters: check their configs, place and burst a job's workers, show what runs where.

- `check`: `tidal cluster validate`'s entry, any kind of file (and the quota files a config names);
- `configs`: a Ray cluster-launcher config, against Ray's schema and Tidal's conventions;
- `kuberay`, `kueue`: KubeRay's RayCluster and RayJob manifests, Kueue's queues;
- `exposure`: what a config exposes to the network and which secrets it writes inline;
- `shell`: just enough shell parsing to read a config's `ray start` and `mlflow server` commands;
- `burst`: where a job's workers run, on-prem first, cloud after a wait;
- `status`: `tidal cluster status`; `cli`: the `tidal cluster` commands.

A node's site and price are at the bottom of the imports (tidal/sites.py, tidal/prices.py), since the team
queue and the workers read them too. Importing this package imports neither ray nor torch; each module
imports Ray where it needs it.
"""
