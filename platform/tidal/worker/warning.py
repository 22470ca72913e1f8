"""Whether a preemption warning leaves time for its emergency checkpoint (pure: no torch, no Ray).

Every warning source (a cloud's notice through `tidal cluster watch-notices`, a Kubernetes pod's
preStop through `tidal cluster drain-node`, Ray's own drain, Tidal's queue) reaches the workers as
one Ray drain with a deadline, read at a log step (worker/loop.py). The save is attempted whatever
the time left: a save cut off by the node's end is never complete (its manifests come last), so
the job resumes from its last complete checkpoint, which nothing removes before a newer one is
complete. What the user must hear is that the warning was too short, so that they lengthen it (a
pod's grace period, docs/cluster.md) or save more often.
"""

from __future__ import annotations

MARGIN_S = 1.0  # what the end of a save needs beyond its blocking time (Ray registering it)


def before_save(left_s: float | None, last_save_s: float | None) -> str | None:
    """A note when the time left before the node goes is already less than the last synchronous
    save of this group took (None: nothing to say, or nothing known)."""
    if left_s is None:
        return None
    if left_s <= 0:
        return (f"the preemption warning came {-left_s:.0f} s after its deadline: saving anyway; if the node goes "
                "first, the job resumes from its last complete checkpoint")
    if last_save_s is not None and left_s < last_save_s + MARGIN_S:
        return (f"the preemption warning leaves {left_s:.1f} s, less than a save takes here ({last_save_s:.1f} s): "
                "saving anyway; if the node goes first, the job resumes from its last complete checkpoint "
                "(lengthen the warning, e.g. the pod's grace period, or checkpoint more often)")
    return None


def after_save(left_s: float | None, took_s: float) -> str | None:
    """A note when the emergency save ended after the warning's deadline: it survived only because
    the node outlived its notice."""
    if left_s is None or took_s <= left_s:
        return None
    return (f"the emergency checkpoint took {took_s:.1f} s, longer than the {max(left_s, 0):.1f} s the preemption "
            "warning left: a node that goes on time would have cut it off, and the job would have resumed from its "
            "last complete checkpoint (lengthen the warning, e.g. the pod's grace period, or checkpoint more often)")
