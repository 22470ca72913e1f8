"""A resize's universal conversion spread over every rank: each reads and writes its share.

DeepSpeed's `ds_to_universal` converts on one machine in two passes, each parallel over
independent items through one function (`_do_parallel_work`, a process pool): *extract* cuts each
old rank's optimizer partition into per-parameter fragments, *merge* joins each parameter's
fragments into `zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`. On rank 0 alone that is the
whole state read, written twice and uploaded by one process, with about 3x the checkpoint on
one node's disk (hours and terabytes at 70B) while every other rank waits.

Here every rank runs DeepSpeed's own `main` in a child process with that one function replaced
(checked against 0.19.8; DeepSpeed has no multi-node converter, hence by hand):
- rank r extracts the old partitions d with d * world // partitions == r, and fetches only those
  (the others are empty files there: DeepSpeed counts partitions by name) and the model states;
- the fragments travel through storage, one bundle per (sender, owner) pair, under the
  conversion's work folder: world^2 objects, not one per fragment;
- rank r merges the parameters it owns (largest first to the least-loaded rank, the same on
  every rank) and uploads them; rank 0 alone writes the common files (the optimizer's
  non-partitioned state, the model states) and, once every rank has reported its files, the
  marker over all of them (`universal.published` reads it as before).
So each rank reads about 1/world of the optimizer state and writes about 1/world of the output.

Nothing read from storage is trusted: a bundle is loaded weights-only by the worker (never the
child, whose DeepSpeed code unpickles without weights-only), its names must be fragments of
parameters this rank owns, and each fragment is written anew before the child reads it.

Ranks meet through storage, not a collective (see tidal.worker.checkpoint.universal for why); a rank that
dies ends the whole group (Ray Train restarts it), and the next attempt starts a new work folder:
`universal.prepare` deleted the old output and names this attempt's work id in the status file.
Checkpoints that are not plain data-parallel (tensor or pipeline parallel files) convert on
rank 0 alone (`universal.ensure`): `route.decide` chooses, once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from tidal import fs
from tidal.errors import CheckpointError
from tidal.storage import Found
from tidal.worker.checkpoint import safe_load, universal
from tidal.worker.checkpoint.fetch import NodeCache
from tidal.worker.checkpoint.route import ANY_MODEL, ANY_OPTIM

FRAGMENT_RE = re.compile(r"^([^/]+)/(\d+)/(fp32|exp_avg|exp_avg_sq|step)\.(\d+)$")
_LOCAL = pafs.LocalFileSystem()
WORK = "tidal-work"  # under the output folder: removed with it, never listed by its marker


@dataclass(frozen=True)
class Share:
    """What one rank reads of a checkpoint folder (names relative to the run folder)."""

    fetch: dict[str, int]  # the model states and the old partitions this rank extracts
    placeholders: list[str]  # the other partitions: empty files, so DeepSpeed counts them
    model_states: str  # the file whose `param_shapes` name every parameter


def extractor(partition: int, partitions: int, world: int) -> int:
    """The rank that extracts old partition `partition` of `partitions`: spread evenly over the
    new ranks in order, so a grown group's nodes share the reading too (rank 0 takes partition 0,
    whose optimizer state it writes as the common file)."""
    return partition * world // partitions


def share(files: dict[str, int], step_tag: str, rank: int, world: int) -> Share:
    """Rank `rank`'s share of the listed `files` of `step_tag`, a plain data-parallel checkpoint
    (`route.plain_data_parallel`: `route.decide` sends any other to rank 0's conversion)."""
    fetch: dict[str, int] = {}
    model: str | None = None
    optims: dict[str, int] = {}
    for rel, size in sorted(files.items()):
        name = rel.removeprefix(f"{step_tag}/")
        optim, states = ANY_OPTIM.match(name), ANY_MODEL.match(name)
        if optim:
            optims[rel] = int(optim[1])
            continue
        fetch[rel] = size  # the model states: small beside the optimizer's, and every rank's loader reads them
        if states and (model is None or int(states[1] or 0) == 0):
            model = rel
    if not model or not optims:
        raise CheckpointError(f"{step_tag} lists no model states or no optimizer partition: nothing to spread")
    holders = []
    for rel, partition in optims.items():
        if extractor(partition, len(optims), world) == rank:
            fetch[rel] = files[rel]
        else:
            holders.append(rel)
    return Share(fetch, holders, model)


def param_sizes(model_states: str) -> dict[str, int]:
    """Parameter name -> element count, from a model states file's `param_shapes` (read weights-only)."""
    shapes = safe_load.safe_load(model_states, mmap=True).get("param_shapes")
    groups = shapes if isinstance(shapes, list) else [shapes]
    if not groups or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{os.path.basename(model_states)} has no parameter shapes to split the conversion by")
    return {fs.check_name(name): math.prod(int(dim) for dim in shape)
            for group in groups for name, shape in group.items()}


def owners(sizes: dict[str, int], world: int) -> dict[str, int]:
    """Who merges each parameter: largest first, to the rank with the fewest elements so far
    (ties to the lower rank). Deterministic, so every rank computes the same."""
    load = [0] * world
    out = {}
    for name, n in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        out[name], load[r] = r, load[r] + n
    return out


def owned_files(dst: str, own: dict[str, int], rank: int) -> list[str]:
    """The output files rank `rank` uploads: `zero/<name>/*` of the parameters it owns (a name no
    rank owns, written by DeepSpeed from the model states, is rank 0's), and every other file on rank 0."""
    out = []
    for rel in fs.files_under(pafs.LocalFileSystem(), dst):
        parts = rel.split("/")
        owner = own.get(parts[1], 0) if parts[0] == "zero" and len(parts) == 3 else 0
        if owner == rank:
            out.append(rel)
    return sorted(out)


def ensure(found: Found, step_tag: str, rank: int, world: int) -> str:
    """The universal tag of `step_tag` (a plain data-parallel checkpoint: `route.decide` sends
    any other to `universal.ensure`), converted by every rank together if need be."""
    out_tag = f"{step_tag}_universal"
    if fs.exists(found.fs, f"{found.path}/{universal.marker(step_tag)}"):
        return out_tag  # rank 0 verified it before any rank read it (restore.agree_on_resume_point)
    files = universal.step_files(found, step_tag)
    mine = share(files, step_tag, rank, world)
    status = fs.read_json(found.fs, f"{found.path}/{universal.status_name(step_tag)}") or {}
    work = status.get("work")
    if not isinstance(work, str) or not re.fullmatch(r"[0-9a-f]{32}", work):
        raise CheckpointError(f"the conversion of {found.name} has no work id from rank 0 (status {status})")
    if rank == 0:
        with universal.Status(found.fs, f"{found.path}/{universal.status_name(step_tag)}", work=work) as beat:
            _Convert(found, step_tag, mine, rank, world, work, files).run(beat)
    else:
        _Convert(found, step_tag, mine, rank, world, work, files).run(types.SimpleNamespace(stage=""))
        universal.wait_for(found, step_tag, out_tag)
    return out_tag


class _Convert:
    """One rank's part of a spread conversion (see the module's docstring)."""

    def __init__(self, found: Found, step_tag: str, mine: Share, rank: int, world: int, work: str,
                 files: dict[str, int]) -> None:
        self.total = sum(files.values())  # the checkpoint's bytes, for the console line
        self.optim = sum(size for rel, size in files.items() if _is_partition(rel))
        self.found, self.step_tag, self.mine, self.rank, self.world = found, step_tag, mine, rank, world
        self.out_tag = f"{step_tag}_universal"
        self.out = f"{found.path}/{self.out_tag}"
        self.root = f"{self.out}/{WORK}/{work}"
        self.work = work
        self.sent = self.received = False
        self.next_look = 0.0  # storage is asked at most every POLL_S
        self.ctl = Path()
        self.tmp = Path()
        self.own: dict[str, int] = {}
        self.listed: set[str] = set()  # the work folder's names at the last look (`_all`)

    def run(self, status: Any) -> None:
        try:
            self._run(status)
        except Exception as e:
            with contextlib.suppress(OSError):  # the others stop waiting for this rank's share (_all)
                fs.write_json(self.found.fs, f"{self.root}/failed-{self.rank}.json",
                              {"error": f"{type(e).__name__}: {e}"[:2000]})
            raise

    def _run(self, status: Any) -> None:
        t0 = time.monotonic()
        fetching = sum(self.mine.fetch.values())
        with NodeCache(f"convert:{self.out}:{self.work}", name=f"convert-{self.found.name}", keep=False) as cache:
            # its copy, the fragments of its partitions, those it receives and its output (about
            # 1/world of the optimizer state each), at once
            partitions = sum(size for rel, size in self.mine.fetch.items() if _is_partition(rel))
            universal.check_disk(cache.dir, fetching + partitions + 2 * self.optim // self.world)
            status.stage = f"fetching {len(self.mine.fetch)} files, {fetching / 2**20:.0f} MiB"
            cache.fetch(self.found.fs, self.found.path, self.mine.fetch)
            status.stage = "checking the files' pickles"
            safe_load.check_files(cache.dir, self.mine.fetch)
            self.own = owners(param_sizes(cache.path(self.mine.model_states)), self.world)
            here = Path(cache.dir) / f"rank{self.rank}"
            shutil.rmtree(here, ignore_errors=True)
            src, dst, self.ctl = here / "in" / self.step_tag, here / "out" / self.out_tag, here / "ctl"
            self.tmp = dst / "tmp"  # DeepSpeed's fragments folder
            for path in (src, self.ctl):
                path.mkdir(parents=True)
            for rel in self.mine.fetch:
                (src / rel.rsplit("/", 1)[-1]).symlink_to(cache.path(rel))
            for rel in self.mine.placeholders:
                (src / rel.rsplit("/", 1)[-1]).touch()
            (self.ctl / "plan.json").write_text(json.dumps({
                "rank": self.rank, "world": self.world, "zero_stage": int(self.found.state["zero_stage"]),
                "owners": self.own, "out": str(dst)}))
            t1 = time.monotonic()
            universal.run_converter(str(src), str(dst), self.mine.fetch, status, module=__name__,
                                    child=[str(self.ctl)], on_poll=self.poll,
                                    ranks_here=int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
            t2 = time.monotonic()
            status.stage = "uploading its share"
            sizes = self.upload(str(dst), here / "up")
            t3 = time.monotonic()
        if self.rank == 0:
            status.stage = "waiting for every rank's share"
            self.publish(sizes)
            print(f"[tidal] resize: converted {self.found.name} ({self.total / 2**20:.0f} MiB) for the new world "
                  f"size in {time.monotonic() - t0:.1f} s across {self.world} rank(s) (rank 0: fetch and check "
                  f"{t1 - t0:.1f} s, convert {t2 - t1:.1f} s, upload {t3 - t2:.1f} s)", flush=True)

    def poll(self) -> None:
        """Between the child's two passes: send the fragments others own, take those this rank owns."""
        if not self.sent and (self.ctl / "extracted").exists():
            self._send()
            self.sent = True
        if self.sent and not self.received and time.monotonic() >= self.next_look and self._all("extracted"):
            self._receive()
            (self.ctl / "go").touch()
            self.received = True

    def _send(self) -> None:
        import torch

        self.found.fs.create_dir(self.root, recursive=True)
        bundles: dict[int, dict[str, Any]] = {}
        for path in sorted(p for p in self.tmp.rglob("*") if p.is_file()):
            rel = path.relative_to(self.tmp).as_posix()
            owner = self._owner(rel)
            if owner != self.rank:
                bundles.setdefault(owner, {})[rel] = safe_load.safe_load(str(path), mmap=True)
        sent = {}
        for owner, bundle in sorted(bundles.items()):
            local = self.ctl / f"to-{owner}.pt"
            torch.save(bundle, local)
            sent[str(owner)] = local.stat().st_size
            self._copy(str(local), _LOCAL, f"{self.root}/frag-{self.rank}-to-{owner}.pt", self.found.fs)
            local.unlink()
            for rel in bundle:
                (self.tmp / rel).unlink()
        fs.write_json(self.found.fs, f"{self.root}/extracted-{self.rank}.json", {"to": sent})

    def _receive(self) -> None:
        import torch

        for peer in range(self.world):
            # a sender's bundles are in storage before its report, so the listing that found
            # every report (`_all`) holds every bundle for this rank
            if peer == self.rank or f"frag-{peer}-to-{self.rank}.pt" not in self.listed:
                continue
            local = self.ctl / f"from-{peer}.pt"
            self._copy(f"{self.root}/frag-{peer}-to-{self.rank}.pt", self.found.fs, str(local), _LOCAL)
            bundle = safe_load.safe_load(str(local), mmap=True)
            if not isinstance(bundle, dict):
                raise CheckpointError(f"rank {peer}'s fragments for rank {self.rank} are not a name -> tensor map")
            for rel, value in bundle.items():
                if self._owner(rel) != self.rank:
                    raise CheckpointError(f"rank {peer}'s fragments for rank {self.rank} hold {rel!r}, "
                                          "which is not a fragment of a parameter this rank merges")
                path = self.tmp / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(value, path)
            local.unlink()

    def _owner(self, rel: str) -> int:
        m = FRAGMENT_RE.match(fs.check_name(rel))
        if not m or m[1] not in self.own:
            raise CheckpointError(f"the conversion made a fragment {rel!r} of no parameter the model states name")
        return self.own[m[1]]

    @staticmethod
    def _copy(src: str, src_fs: pafs.FileSystem, dst: str, dst_fs: pafs.FileSystem) -> None:
        pafs.copy_files(src, dst, source_filesystem=src_fs, destination_filesystem=dst_fs)

    def _all(self, what: str) -> bool:
        """Whether every rank wrote `what`; CheckpointError once any rank reports a failure."""
        self.next_look = time.monotonic() + universal.POLL_S
        names = self.listed = {i.base_name for i in fs.list_dir(self.found.fs, self.root)}
        failed = sorted(n for n in names if n.startswith("failed-"))
        if failed:
            doc = fs.read_json(self.found.fs, f"{self.root}/{failed[0]}") or {}
            raise CheckpointError(f"rank {failed[0][7:-5]} could not do its share of the conversion of "
                                  f"{self.found.name}: {doc.get('error')}")
        return all(f"{what}-{r}.json" in names for r in range(self.world))

    def upload(self, dst: str, up: Path) -> dict[str, int]:
        for rel in owned_files(dst, self.own, self.rank):
            (up / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(os.path.join(dst, rel), up / rel)
        sizes = fs.upload_into(str(up), self.found.fs, self.out) if up.exists() else {}
        fs.write_json(self.found.fs, f"{self.root}/merged-{self.rank}.json", {"files": sizes})
        return sizes

    def publish(self, mine: dict[str, int]) -> None:
        """Rank 0: the marker over every rank's files, once each has reported them."""
        deadline = time.monotonic() + universal.timeout_s()
        while not self._all("merged"):
            if time.monotonic() > deadline:
                raise CheckpointError(f"ranks did not report their share of the conversion of {self.found.name} "
                                      f"within {universal.TIMEOUT_ENV}={universal.timeout_s():.0f} s")
            time.sleep(universal.POLL_S)
        files = dict(mine)
        for r in range(1, self.world):
            doc = fs.read_json(self.found.fs, f"{self.root}/merged-{r}.json") or {}
            files.update(fs.checked_files(doc.get("files")))
        fs.write_json(self.found.fs, f"{self.found.path}/{universal.marker(self.step_tag)}",
                      {"files": files, "id": self.work})
        fs.delete_dir(self.found.fs, f"{self.out}/{WORK}")


def _is_partition(rel: str) -> bool:
    return ANY_OPTIM.match(rel.rsplit("/", 1)[-1]) is not None


def _patch(d: Any, plan: dict[str, Any], ctl: Path) -> None:
    """Make DeepSpeed's `ds_to_universal` (module `d`) do this rank's share only."""
    rank, world, own, out = plan["rank"], plan["world"], plan["owners"], plan["out"]
    parallel = d._do_parallel_work
    extract = (d.extract_zero_shards, d.extract_zero_shards_stage3)

    def work(do_work: Any, chunks: Any, n: int) -> Any:
        fn, chunks = getattr(do_work, "func", None), list(chunks)
        if fn in extract:  # items end with the old data-parallel index (one item per partition here)
            done = parallel(do_work, [c for c in chunks if extractor(c[-1], len(chunks), world) == rank], n)
            _handoff(ctl)
            return done
        if fn in (d.merge_tp_slices, d.merge_zero3_slices):
            name = (lambda c: c[0]) if fn is d.merge_tp_slices else (lambda c: c)
            done = parallel(do_work, [c for c in chunks if own.get(name(c), 0) == rank], n)
            for c in chunks:  # others' parameters: present, so the model-states fallback skips them
                if own.get(name(c), 0) != rank:
                    os.makedirs(os.path.join(out, "zero", name(c)), exist_ok=True)
                    Path(out, "zero", name(c), "fp32.pt").touch()
            return done
        return parallel(do_work, chunks, n)

    d._do_parallel_work = work
    d._get_zero_stage = lambda files: plan["zero_stage"]  # saved by Tidal; the partition that holds it may be absent
    if rank != 0:  # common files are rank 0's
        d._save_optimizer_state = d._save_optimizer_state_stage3 = lambda *a, **k: None
    d.shutil = types.SimpleNamespace(rmtree=shutil.rmtree, copy2=_link if rank == 0 else lambda *a, **k: None)


def _link(src: str, folder: str) -> None:
    """The model states into the output: a hard link where the filesystem allows (the same bytes)."""
    dst = os.path.join(folder, os.path.basename(src))
    try:
        os.link(os.path.realpath(src), dst)
    except OSError:
        shutil.copy2(src, dst)


def _handoff(ctl: Path) -> None:
    """Tell the worker the fragments are out, and wait for it to bring this rank's in."""
    (ctl / "extracted").touch()
    print("*** 1b. Exchanging fragments with the other ranks", flush=True)
    while not (ctl / "go").exists():
        time.sleep(0.2)


def _child(argv: list[str]) -> None:
    threading.Thread(target=universal.die_with, args=(int(argv[0]),), daemon=True).start()
    from deepspeed.checkpoint import ds_to_universal

    ctl = Path(argv[1])
    ds_to_universal.torch.load = universal.tensors_of_module(ds_to_universal.torch.load)  # this process only
    _patch(ds_to_universal, json.loads((ctl / "plan.json").read_text()), ctl)
    sys.argv = ["ds_to_universal", *argv[2:]]
    ds_to_universal.main(ds_to_universal.parse_arguments())


if __name__ == "__main__":
    _child(sys.argv[1:])
