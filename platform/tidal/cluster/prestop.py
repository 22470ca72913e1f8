"""A KubeRay worker pod's `preStop` and its grace period: the pod must outlive the drain its preStop
asks for (`tidal cluster drain-node --deadline-s N`), or Kubernetes kills it mid-save. Kubernetes
counts `terminationGracePeriodSeconds` from the start of the preStop and sends SIGTERM only when
the preStop returns (at the deadline): Ray then needs a few seconds to stop."""

from __future__ import annotations

from typing import Any

from tidal.cluster.configs import Problem

K8S_DEFAULT_GRACE_S = 30  # Kubernetes' default terminationGracePeriodSeconds
RAY_STOP_S = 10  # what Ray's node is left, after the deadline, to stop before SIGKILL


def drain_deadline_s(container: dict[str, Any]) -> float | None:
    """The --deadline-s of the container's `tidal cluster drain-node` preStop; None without one."""
    command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command") or []
    words = [str(w) for w in command]
    if "drain-node" not in " ".join(words):
        return None
    for i, w in enumerate(words):
        if w == "--deadline-s" and i + 1 < len(words):
            return float(words[i + 1])
        if w.startswith("--deadline-s="):
            return float(w.split("=", 1)[1])
    return None


def prestop_problems(where: str, pod: dict[str, Any]) -> list[Problem]:
    """A worker pod whose Ray container drains on stop must have the grace to let it finish."""
    containers = [c for c in pod.get("containers") or [] if isinstance(c, dict)]
    deadline = drain_deadline_s(containers[0]) if containers else None  # KubeRay's Ray node: the first
    if deadline is None:
        return []
    grace = pod.get("terminationGracePeriodSeconds", K8S_DEFAULT_GRACE_S)
    if not isinstance(grace, int | float) or grace < deadline + RAY_STOP_S:
        return [(f"{where}.template.spec.terminationGracePeriodSeconds",
                 f"{grace} does not outlast the preStop's drain deadline of {deadline:g} s plus {RAY_STOP_S} s for "
                 f"Ray to stop: Kubernetes kills the pod during the job's save; set it to at least "
                 f"{int(deadline) + RAY_STOP_S}")]
    return []
