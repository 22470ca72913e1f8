"""What a restart and a resize cost, measured here and computed at scale from Tidal's own planning.

    python -m benchmarks.resize_cost paper                       # the scale table (docs/reliability.md)
    python -m benchmarks.resize_cost measure --rounds 4          # quickstart size, 2 workers
    python -m benchmarks.resize_cost measure --rounds 4 --d-model 1024 --layers 8   # ~1.5 GB state
    python -m benchmarks.resize_cost measure --rounds 4 --d-model 1024 --layers 8 --zero-stage 3

`paper`: 7B and 70B, ZeRO-2 and ZeRO-3, 8-GPU nodes, 8 -> 16 -> 8 nodes, from the same functions a
restore runs: `tidal.worker.checkpoint.fetch.rank_files` picks each rank's files of a listing laid out as
DeepSpeed writes it, `tidal.worker.checkpoint.share.partition` a ZeRO-3 rank's share of each universal file,
`tidal.worker.checkpoint.universal_spread.share` and `.owners` each rank's part of the conversion (its old
partitions, the parameters it merges; `rank0`: the same conversion on rank 0 alone, as
`tidal.worker.checkpoint.universal` makes it for what is not plain data-parallel); requests are those of
`tidal.worker.checkpoint.restore` (rank 0 lists and verifies once, each rank asks for its own files). Bandwidths
are stated, not measured; the conversion's own compute is left out (it adds to the resize time).

`measure`: rounds alternate a same-size resume (2 -> 2), a shrink (2 -> 1) and a grow (1 -> 2) of one
job on a local path, each round reported: seconds from `tidal run` to the first step trained after
the resume (its MLflow timestamp), bytes the restores copied from storage per rank (the node cache's
copies) and the node cache's peak disk.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import history, in_turn, latest_run_id, tidal_run, write_spec
from benchmarks.reshard import DiskPeak, disk_bytes
from tidal.spec.job import JobSpec
from tidal.worker.checkpoint import (
    fetch,
    repartition,
    repartition_zero3,
    share,
    universal,
    universal_spread,
)

GB = 1e9


# --- paper ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    name: str
    params: int
    layers: int
    d: int
    vocab: int

    def tensors(self) -> dict[str, int]:
        """Parameter name -> elements, a Llama-like decoder (attention 4 d^2, MLP 3 x d x 8d/3, 2 norms)."""
        out = {"tok.weight": self.vocab * self.d}
        ff = int(8 * self.d / 3)
        for i in range(self.layers):
            out |= {f"blocks.{i}.{k}.weight": self.d * self.d for k in ("q", "k", "v", "o")}
            out |= {f"blocks.{i}.{k}.weight": self.d * ff for k in ("gate", "up", "down")}
            out |= {f"blocks.{i}.ln{j}.weight": self.d for j in (1, 2)}
        out["ln_f.weight"], out["head.weight"] = self.d, self.vocab * self.d
        return out


MODELS = [Model("7B", 7_000_000_000, 32, 4096, 32000), Model("70B", 70_000_000_000, 80, 8192, 32000)]


def zero_listing(m: Model, stage: int, world: int) -> dict[str, int]:
    """A ZeRO checkpoint's listed files as DeepSpeed 0.19 writes them (bf16 training, Adam): each
    rank's optimizer partition (fp32 master, exp_avg, exp_avg_sq: 12 bytes a parameter); the bf16
    module once (ZeRO-2, rank 0) or partitioned (ZeRO-3, one file per rank)."""
    n = sum(m.tensors().values())
    out = {f"global_step1/zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 12 * n // world for r in range(world)}
    if stage == 3:
        out |= {f"global_step1/zero_pp_rank_{r}_mp_rank_00_model_states.pt": 2 * n // world for r in range(world)}
        out["global_step1/mp_rank_00_model_states.pt"] = 2**20
    else:
        out["global_step1/mp_rank_00_model_states.pt"] = 2 * n
    return out


def universal_listing(m: Model, stage: int) -> dict[str, int]:
    """What `ds_to_universal` writes: per parameter fp32, exp_avg, exp_avg_sq (4 bytes an element)
    and step, the optimizer's global state, and the old rank 0's model states."""
    out = {"zero/optimizer_state.pt": 2**20, "mp_rank_00_model_states.pt": 2**20 if stage == 3 else 2 * m.params}
    for name, numel in m.tensors().items():
        out |= {f"zero/{name}/{key}.pt": 4 * numel for key in ("fp32", "exp_avg", "exp_avg_sq")}
        out[f"zero/{name}/step.pt"] = 1024
    return out


def held_params(m: Model, world: int, rank: int) -> set[str]:
    """ZeRO-1/2: the parameters whose elements rank `rank`'s equal share of the flat fp32 buffer
    (parameters in order) overlaps (what `restore._held_params` reads from the engine)."""
    sizes = m.tensors()
    total = sum(sizes.values())
    per = math.ceil(total / world)
    lo, hi, at, out = rank * per, min((rank + 1) * per, total), 0, set()
    for name, numel in sizes.items():
        if at < hi and at + numel > lo:
            out.add(name)
        at += numel
    return out


def requests_per_share() -> int:
    """Storage requests one ZeRO-3 share of one universal file takes (`share.fetch_share` on a real
    archive, each read counted as S3 counts a ranged GET), plus the file's size check."""
    import pyarrow as pa
    import pyarrow.fs as pafs
    import torch

    class Reads(io.RawIOBase):
        def __init__(self, path: str) -> None:
            self.f, self.n = open(path, "rb"), 0  # noqa: SIM115 - closed with the wrapper

        def read(self, n: int = -1) -> bytes:
            self.n += 1
            return self.f.read(n)

        def seek(self, pos: int, whence: int = 0) -> int:
            return self.f.seek(pos, whence)

        def tell(self) -> int:
            return self.f.tell()

        def readable(self) -> bool:
            return True

        def seekable(self) -> bool:
            return True

    opened: list[Reads] = []

    class Handler(pafs.FileSystemHandler):
        def open_input_file(self, path: str) -> pa.NativeFile:
            opened.append(Reads(path))
            return pa.PythonFile(opened[-1], mode="r")

    for name in ("get_type_name", "normalize_path", "equals", "get_file_info", "get_file_info_selector", "create_dir",
                 "delete_dir", "delete_dir_contents", "delete_root_dir_contents", "delete_file", "move", "copy_file",
                 "open_input_stream", "open_output_stream", "open_append_stream"):
        setattr(Handler, name, lambda *a, **k: None)
    Handler.__abstractmethods__ = frozenset()
    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/fp32.pt"
        torch.save({"param": torch.zeros(2**20), "cat_dim": 0}, src)  # a tensor larger than both ends
        share.fetch_share(pafs.PyFileSystem(Handler()), src, f"{tmp}/out.pt", os.path.getsize(src), 4, 1)
    return opened[0].n + 1


def node_bytes(files: list[dict[str, int]]) -> int:
    """Bytes a node reads for its ranks' file lists: each file once (the node's shared cache)."""
    merged: dict[str, int] = {}
    for f in files:
        merged |= f
    return sum(merged.values())


def zero3_share_bytes(listing: dict[str, int], world: int, rank: int) -> int:
    """A ZeRO-3 rank's bytes of a universal folder: its partition of each sliced file, the rest whole."""
    out = 0
    for rel, size in listing.items():
        if share.sliced(rel):
            lo, hi = share.partition(size // 4, world, rank)
            out += 4 * (hi - lo) + 2048  # the archive's directory and pickle (tidal.worker.checkpoint.share.layout)
        else:
            out += size
    return out


# A direct ZeRO-1/2 resize reads, per old partition file it touches, its size, both ends (share.EDGE
# each) and one range per partitioned tensor (fp32 master, exp_avg, exp_avg_sq): tidal.worker.checkpoint.repartition.
DIRECT_REQUESTS_PER_FILE = 1 + 2 + 3


def _direct(nodes: list[int], requests: int, new_nodes: int, node_bps: float, store_bps: float) -> dict[str, float]:
    """A direct resize's row from each node's bytes read: what a node reads is what it holds after,
    on disk too; the transfer is bound by the busiest node's link or the storage's total."""
    aggregate = min(store_bps, node_bps * new_nodes)
    return {"read0": nodes[0], "read": max(nodes), "disk0": nodes[0], "disk": max(nodes), "held": max(nodes),
            "requests": requests, "s": max(max(nodes) / node_bps, sum(nodes) / aggregate)}


def direct_row(m: Model, old_world: int, new_nodes: int, gpus: int, ckpt: dict[str, int],
               node_bps: float, store_bps: float, verify: int) -> dict[str, float]:
    """A ZeRO-2 resize by byte range (tidal.worker.checkpoint.repartition.pieces): each rank reads its new
    partition's slices of the old partitions (12 bytes an element) and the archives' ends; each node
    the bf16 module once. No conversion: what a node reads is what it holds after, on disk too."""
    n, new_world = sum(m.tensors().values()), new_nodes * gpus
    module = ckpt["global_step1/mp_rank_00_model_states.pt"]
    nodes, requests = [], verify
    for node in range(new_nodes):
        read = module
        for rank in range(node * gpus, (node + 1) * gpus):
            parts = repartition.pieces(n, old_world, new_world, rank)
            read += sum(12 * (p.hi - p.lo) for p in parts) + 2 * share.EDGE * len(parts)
            requests += 2 + DIRECT_REQUESTS_PER_FILE * len(parts)
        nodes.append(read)
    return _direct(nodes, requests, new_nodes, node_bps, store_bps)


SUB_GROUP = 10**9  # DeepSpeed's ZeRO-3 sub_group_size, which Tidal leaves as it is


def zero3_direct_row(m: Model, old_world: int, new_nodes: int, gpus: int, ckpt: dict[str, int],
                     node_bps: float, store_bps: float, verify: int) -> dict[str, float]:
    """A ZeRO-3 resize by byte range (tidal.worker.checkpoint.repartition_zero3.pieces, sub-groups cut by
    `layout` at each size): each rank reads its new partitions' slices of the old ones (fp32 master,
    exp_avg, exp_avg_sq: a record each, 12 bytes an element) and the ends of each old file it
    touches; each node old rank 0's model states once. A read per run of slices end to end
    (`repartition.merged`), per record."""
    numels, new_world = list(m.tensors().values()), new_nodes * gpus
    old, _ = repartition_zero3.layout([numels], old_world, SUB_GROUP)
    new, _ = repartition_zero3.layout([numels], new_world, SUB_GROUP)
    model = ckpt["global_step1/zero_pp_rank_0_mp_rank_00_model_states.pt"]
    nodes, requests = [], verify
    for node in range(new_nodes):
        read, requests = model, requests + 2
        for rank in range(node * gpus, (node + 1) * gpus):
            plan = repartition_zero3.pieces(numels, old, new, old_world, new_world, rank)
            files = {p.old for p in plan}
            runs = sum(len(repartition.merged([(p.lo, p.hi) for p in plan if (p.old, p.group) == key]))
                       for key in {(p.old, p.group) for p in plan})
            read += sum(12 * (p.hi - p.lo) for p in plan) + 2 * share.EDGE * len(files)
            requests += 3 * len(files) + 3 * runs
        nodes.append(read)
    return _direct(nodes, requests, new_nodes, node_bps, store_bps)


def paper_row(m: Model, stage: int, old_nodes: int, new_nodes: int, gpus: int, node_gbps: float,
              store_gbps: float, shares: int, via: str = "by_range") -> dict[str, object]:
    old_world, new_world = old_nodes * gpus, new_nodes * gpus
    ckpt = zero_listing(m, stage, old_world)
    state = sum(ckpt.values())
    tag = {rel.removeprefix("global_step1/"): size for rel, size in ckpt.items()}
    # Same-size restart: each node reads its ranks' files (fetch.rank_files), once per node.
    same = max(node_bytes([fetch.rank_files(tag, node * gpus + g) for g in range(gpus)]) for node in range(old_nodes))
    # Requests (tidal.worker.checkpoint.restore): rank 0 lists the run, reads the state file and each rank's
    # manifest, asks about each listed file; each rank then asks for and reads each of its files.
    verify = 2 + old_world + len(ckpt)
    same_requests = verify + 2 * sum(len(fetch.rank_files(tag, r)) for r in range(old_world))
    node_bps, store_bps = node_gbps * GB / 8, store_gbps * GB / 8
    same_s = max(same / node_bps, same * old_nodes / min(store_bps, node_bps * old_nodes))
    row = {"model": m.name, "zero": stage, "via": via, "state_gb": state / GB, "same_gb": same / GB,
           "same_s": same_s, "same_requests": same_requests}
    if via == "by_range":
        d = (direct_row if stage == 2 else zero3_direct_row)(m, old_world, new_nodes, gpus, ckpt, node_bps,
                                                             store_bps, verify)
        return {**row, "resize_gb_node0": d["read0"] / GB, "resize_gb_node": d["read"] / GB,
                "disk_gb_node0": d["disk0"] / GB, "disk_gb_node": d["disk"] / GB, "disk_over_held": 1.0,
                "resize_requests": d["requests"], "resize_s": d["s"]}
    # Resize: the ranks convert together (below), then every node reads its ranks' share of the
    # universal folder.
    uni = universal_listing(m, stage)
    if stage == 3:
        per_node = [sum(zero3_share_bytes(uni, new_world, node * gpus + g) for g in range(gpus))
                    - (gpus - 1) * sum(s for r, s in uni.items() if not share.sliced(r)) for node in range(new_nodes)]
    else:
        per_node = [node_bytes([fetch.rank_files(uni, 0, held_params(m, new_world, node * gpus + g))
                                for g in range(gpus)]) for node in range(new_nodes)]
    load = max(per_node)
    if via == "rank0":
        # The conversion on rank 0 alone (universal._convert): node 0 fetches every listed file, holds
        # the copy, DeepSpeed's fragments and the output at once (universal.conversion_disk), and
        # uploads the output; every other node waits, then each reads its share of the output.
        out = sum(uni.values())
        disk0 = universal.conversion_disk(state)
        convert_requests = 2 * len(ckpt) + len(uni)
        if stage == 3:
            sliced_files = sum(share.sliced(rel) for rel in uni)
            per_rank = shares * sliced_files + 2 * (len(uni) - sliced_files)
        else:
            per_rank = 2 * max(len(fetch.rank_files(uni, 0, held_params(m, new_world, r))) for r in range(0, new_world, gpus))
        aggregate = min(store_bps, node_bps * new_nodes)
        resize_s = (state + out) / node_bps + max(load / node_bps, load * new_nodes / aggregate)
        return {**row, "resize_gb_node0": (state + load) / GB, "resize_gb_node": (state + load) / GB,
                "disk_gb_node0": (disk0 + load) / GB, "disk_gb_node": (disk0 + load) / GB,
                "disk_over_held": (disk0 + load) / load,
                "resize_requests": verify + convert_requests + per_rank * new_world, "resize_s": resize_s}
    # The conversion, spread (universal_spread): each rank fetches its share (old partitions d with
    # d * new_world // partitions == rank, and the model states once per node), sends the fragments of parameters
    # others own (about its partitions' bytes times their share), receives its own parameters'
    # fragments and uploads their universal files. Per node, the busiest node.
    sizes = m.tensors()
    own = universal_spread.owners(sizes, new_world)
    total = sum(sizes.values())
    optim = sum(size for rel, size in ckpt.items() if "optim_states" in rel)
    nodes = []
    for node in range(new_nodes):
        ranks = range(node * gpus, (node + 1) * gpus)
        mine = [universal_spread.share(ckpt, "global_step1", r, new_world) for r in ranks]
        read = node_bytes([s.fetch for s in mine])
        extracted = sum(size for s in mine for rel, size in s.fetch.items() if "optim_states" in rel)
        owned = sum(n for name, n in sizes.items() if own[name] in ranks) / total
        received = (optim - extracted) * owned
        written = sum(size for rel, size in uni.items() if rel.startswith("zero/") and rel.count("/") == 2
                      and own.get(rel.split("/")[1], 0) in ranks)
        traffic = read + extracted * (1 - owned) + received + written
        nodes.append({"read": read + received, "disk": read + extracted + received + written, "traffic": traffic})
    busiest = max(nodes, key=lambda n: n["traffic"])
    node0 = nodes[0]
    # Requests: rank 0's verify, each rank's share, a bundle per (sender, owner) pair put and got,
    # two reports a rank, the output files once, and the load's own.
    senders = sum(1 for r in range(new_world) if any("optim" in rel
                                                    for rel in universal_spread.share(ckpt, "global_step1", r, new_world).fetch))
    bundles = senders * len(set(own.values()))
    convert_requests = 2 * sum(len(universal_spread.share(ckpt, "global_step1", r, new_world).fetch)
                               for r in range(new_world)) + 2 * bundles + 2 * new_world + len(uni)
    if stage == 3:
        sliced_files = sum(share.sliced(rel) for rel in uni)
        per_rank = shares * sliced_files + 2 * (len(uni) - sliced_files)
    else:
        per_rank = 2 * max(len(fetch.rank_files(uni, 0, held_params(m, new_world, r))) for r in range(0, new_world, gpus))
    resize_requests = verify + convert_requests + per_rank * new_world
    aggregate = min(store_bps, node_bps * new_nodes)
    all_traffic = sum(n["traffic"] for n in nodes)
    resize_s = (max(busiest["traffic"] / node_bps, all_traffic / aggregate)
                + max(load / node_bps, load * new_nodes / aggregate))
    return {**row, "resize_gb_node0": (node0["read"] + load) / GB,
            "resize_gb_node": (busiest["read"] + load) / GB, "disk_gb_node0": (node0["disk"] + load) / GB,
            "disk_gb_node": (busiest["disk"] + load) / GB, "disk_over_held": (busiest["disk"] + load) / load,
            "resize_requests": resize_requests, "resize_s": resize_s}


def paper(args: argparse.Namespace) -> None:
    shares = requests_per_share()
    cases = [(stage, via, old, new) for stage, via in ((2, "by_range"), (3, "by_range"), (3, "universal"), (3, "rank0"))
             for old, new in ((8, 16), (16, 8))]
    rows = [(paper_row(m, stage, old, new, args.gpus, args.node_gbps, args.store_gbps, shares, via), old, new)
            for m in MODELS for stage, via, old, new in cases]
    print(f"{args.gpus}-GPU nodes; node link {args.node_gbps:g} Gbit/s, storage {args.store_gbps:g} Gbit/s in all; "
          f"a ZeRO-3 share of one universal file takes {shares} requests\n")
    print("| model | ZeRO | resize | nodes | state | restart: read per node | restart: requests | restart: s | "
          "resize: read, node 0 / busiest | resize: peak disk, node 0 / busiest | peak disk / held after | "
          "resize: requests | resize: s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row, old, new in rows:
        print(f"| {row['model']} | {row['zero']} | {row['via']} | {old} -> {new} | {row['state_gb']:.0f} GB "
              f"| {row['same_gb']:.1f} GB | {row['same_requests']:,} | {row['same_s']:.0f} "
              f"| {row['resize_gb_node0']:.0f} / {row['resize_gb_node']:.1f} GB "
              f"| {row['disk_gb_node0']:.0f} / {row['disk_gb_node']:.1f} GB | {row['disk_over_held']:.1f}x "
              f"| {row['resize_requests']:,} | {row['resize_s']:.0f} |")


# --- measure ----------------------------------------------------------------------------------------

def job(base: Path, d_model: int, layers: int, steps: int, workers: int, stage: int = 2) -> JobSpec:
    return JobSpec(
        name="resize-cost", model={"n_layer": layers, "n_head": max(2, d_model // 64), "d_model": d_model,
                                   "vocab_size": 256, "seq_len": 64},
        train={"steps": steps, "micro_batch": 2, "global_batch": 4, "lr": 1e-4, "warmup_steps": 1, "log_every": 1},
        parallelism={"zero_stage": stage}, scaling={"min_workers": workers, "max_workers": workers},
        checkpoint={"every_steps": 1, "keep": 2, "storage": str(base / "runs")},
        tracking={"uri": f"sqlite:///{base}/mlflow.db", "experiment": "resize-cost"},
        worker_env={fetch.CACHE_ENV: str(base / "cache")})


def one(base: Path, args: argparse.Namespace, step: int, before: int, after: int) -> dict[str, float]:
    """Save at `before` workers to `step`, then resume at `after` to `step + 1`: the second launch timed."""
    base.mkdir(parents=True, exist_ok=True)
    write_spec(job(base, args.d_model, args.layers, step + 1, before, args.zero_stage).with_overrides({"train.stop_at": step}),
               base / "a.yaml")
    tidal_run(base / "a.yaml")
    spec = job(base, args.d_model, args.layers, step + 1, after, args.zero_stage)
    write_spec(spec, base / "b.yaml")
    with DiskPeak(str(base / "cache")) as disk:
        t0 = time.time()
        tidal_run(base / "b.yaml")
    first = history(spec, latest_run_id(spec), "loss")[step + 1][1] / 1000
    copied = sum(disk_bytes(p.stat()) for p in (base / "cache").rglob("*") if p.is_file() and not p.is_symlink())
    return {"s": first - t0, "copied_per_rank_mb": copied / after / 2**20, "peak_disk_mb": disk.peak / 2**20}


def measure(args: argparse.Namespace) -> None:
    base = Path(args.dir or tempfile.mkdtemp(prefix="tidal-resize-cost-"))
    kinds = {"same 2->2": (2, 2), "shrink 2->1": (2, 1), "grow 1->2": (1, 2)}
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    step = 2  # each launch pair has a folder of its own: the same short save in every round
    for r in range(args.rounds):
        order = list(in_turn(r, *kinds))
        for kind in order:
            rows[kind].append(one(base / f"r{r}-{kind.split()[0]}", args, step, *kinds[kind]))
            print(f"round {r + 1} {kind}: {json.dumps(rows[kind][-1])}", flush=True)
    same = [g["s"] for g in rows["same 2->2"]]
    for kind in ("shrink 2->1", "grow 1->2"):  # each round's resize over the same round's restart
        ratios = [g["s"] / s for g, s in zip(rows[kind], same, strict=True)]
        print(f"{kind} / same 2->2, each round: {', '.join(f'{r:.2f}' for r in ratios)}; median "
              f"{statistics.median(ratios):.2f}")
    for kind, got in rows.items():
        each = ", ".join(f"{g['s']:.1f}" for g in got)
        print(f"{kind}: median {statistics.median(g['s'] for g in got):.1f} s ({each}); copied per rank "
              f"{statistics.median(g['copied_per_rank_mb'] for g in got):.0f} MiB; peak disk "
              f"{statistics.median(g['peak_disk_mb'] for g in got):.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("paper")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--node-gbps", type=float, default=100.0, help="each node's link to storage, Gbit/s")
    p.add_argument("--store-gbps", type=float, default=800.0, help="the storage's total bandwidth, Gbit/s")
    m = sub.add_parser("measure")
    m.add_argument("--rounds", type=int, default=4)
    m.add_argument("--d-model", type=int, default=64)
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--dir", default=None)
    m.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    args = ap.parse_args()
    paper(args) if args.mode == "paper" else measure(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
