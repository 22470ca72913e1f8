"""The rendezvous's one decision (failure.replace_in_place): which generation of the group a joining rank enters, and when one is formed.

Each generation is one torch process group over the job's workers. Every rank that starts or
re-forms (a new worker, a replacement, a survivor whose collective lost its peer) joins the
generation being formed; once all `world` ranks joined it, it is formed and each rank builds its
process group under that generation's prefix in the rendezvous's store. A join that cannot belong
with the ranks already in the forming generation abandons it and opens the next: another world
size (a restart at another size), or a rank already there under another process's token (that
rank died and was replaced while the others waited). Ranks waiting on an abandoned generation
learn it at their next look and join again. Pure: `join` and `status` read and return a `Rounds`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["formed", "waiting", "abandoned"]


@dataclass(frozen=True)
class Rounds:
    forming: int = 1  # the generation ranks join now
    world: int = 0  # its size (0: nobody joined it yet)
    members: tuple[tuple[int, str], ...] = ()  # (rank, token) that joined it, in rank order
    formed: tuple[int, ...] = ()  # the generations formed, oldest first
    last: dict[int, str] = field(default_factory=dict)  # the newest formed generation's rank -> token
    reached: int = 0  # the newest step a rank joining the forming generation had trained
    replaced: tuple[int, ...] = ()  # the ranks the newest formed generation has in new processes, beside kept ones
    lost_after: int = 0  # the newest step trained before it formed (the `reached` of its joins)


def join(r: Rounds, rank: int, world: int, token: str, step: int = 0) -> tuple[Rounds, int]:
    """The rendezvous after `rank` (of `world`, its process's `token`, having trained to `step`) joined,
    and the generation it is in."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} cannot join a group of {world} worker(s)")
    members = dict(r.members)
    if members and (world != r.world or members.get(rank, token) != token):
        r = dataclasses.replace(r, forming=r.forming + 1, world=0, members=())  # abandoned: it cannot form
        members = {}
    members[rank] = token
    gen, reached = r.forming, max(r.reached if r.members else 0, step)
    if len(members) < world:
        return dataclasses.replace(r, world=world, members=tuple(sorted(members.items())), reached=reached), gen
    # the ranks in new processes, once a group of this size formed before (the first forms all new); none
    # when every rank is new: no process was kept, so nothing was replaced in place (a full restart, or a
    # survivor lost while it re-formed and replaced too)
    replaced = tuple(k for k, t in sorted(members.items()) if r.last.get(k) != t) if len(r.last) == world else ()
    replaced = replaced if len(replaced) < world else ()
    return Rounds(forming=gen + 1, formed=(*r.formed, gen)[-16:], last=members, replaced=replaced,
                  lost_after=reached), gen


def status(r: Rounds, gen: int) -> Status:
    """What a rank that joined `gen` does: build its process group, wait, or join again."""
    if gen in r.formed:
        return "formed"
    return "waiting" if gen == r.forming else "abandoned"
