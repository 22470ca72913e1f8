"""User code named in the spec (`module:function`) and the optimizer by name: checks at spec load,
and `call_problems`: each function against the arguments the spec gives it, before anything starts.

The workers import the user's code (tidal.worker.user_code). The driver and `tidal validate` import
it too, only to check each function's signature (`inspect.signature(...).bind`): a builder that
cannot take the spec's arguments is refused before Ray starts, naming the field and what to change,
instead of failing on every worker. A module that does not import here (it may need libraries or
devices only the workers have) is left to the workers, with a note.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tidal.errors import SpecError

if TYPE_CHECKING:
    from tidal.spec.job import JobSpec

REF = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")

# What each optimizer accepts besides lr and weight_decay (those come from train.lr / train.weight_decay).
# Checked here so that a typo fails at load, not after the workers started.
OPTIMIZER_ARGS = {
    "AdamW": ("betas", "eps"),
    "Adam": ("betas", "eps"),
    "SGD": ("momentum", "dampening", "nesterov"),
    "Lion": ("betas",),
}
RESHARDABLE = ("AdamW", "Adam")  # what ds_to_universal converts: exp_avg and exp_avg_sq
FROM_TRAIN = {"lr": "train.lr", "weight_decay": "train.weight_decay"}


WHERE = ("the module must be importable on every worker: put it in the directory you start `tidal run` from "
         "(or the --working-dir of `tidal submit`), or install it on every node")


def check_ref(value: str | None) -> str | None:
    """A pydantic field validator: `pkg.module:function`, or a message saying how to write one."""
    if value is None or REF.match(value):
        return value
    raise ValueError(f"{value!r} is not a 'module:function' reference; write e.g. 'my_models.mlp:build' for the "
                     "function build in my_models/mlp.py, relative to the job's working directory (where you run "
                     "tidal, or the --working-dir of tidal submit)")


def user_code_problems(spec: JobSpec) -> list[tuple[str, str]]:
    m, d, t, par = spec.model, spec.data, spec.train, spec.parallelism
    problems: list[tuple[str, str]] = []
    if d.dataset and d.source != "synthetic":
        problems.append(("data.dataset", f"replaces data.source ({d.source!r}); keep one of them"))
    if d.dataset_args and not d.dataset:
        problems.append(("data.dataset_args", "are arguments for data.dataset, which is not set"))
    if m.builder_args and not m.builder:
        problems.append(("model.builder_args", "are arguments for model.builder, which is not set"))
    if par.pipeline_stages > 1 and (d.dataset or t.step_fn):
        field = "data.dataset" if d.dataset else "train.step_fn"
        problems.append((field, "pipeline stages run the built-in GPT on token batches only; use ZeRO-3 "
                         "(parallelism.pipeline_stages 1) with your own data or step"))
    problems += _optimizer_problems(spec)
    return problems


def _optimizer_problems(spec: JobSpec) -> list[tuple[str, str]]:
    opt, par = spec.train.optimizer, spec.parallelism
    problems: list[tuple[str, str]] = []
    allowed = OPTIMIZER_ARGS[opt.name]
    for key in opt.args:
        if key in FROM_TRAIN:
            problems.append((f"train.optimizer.args.{key}", f"conflicts with {FROM_TRAIN[key]} (Tidal derives it); "
                             f"set {FROM_TRAIN[key]} instead"))
        elif key not in allowed:
            problems.append((f"train.optimizer.args.{key}", f"{opt.name} takes {', '.join(allowed)} here "
                             "(lr and weight_decay come from train.lr and train.weight_decay)"))
    if opt.name not in RESHARDABLE and spec.elastic and par.zero_stage > 0:
        problems.append(("train.optimizer.name", f"{opt.name} cannot change world size under ZeRO: Tidal reshards "
                         "through DeepSpeed's universal checkpoints, which carry Adam's state only; use AdamW or Adam "
                         "for an elastic job, or fix its size (scaling.min_workers = scaling.max_workers)"))
    if opt.name == "Lion" and spec.scaling.gpus_per_worker == 0 and par.offload_optimizer == "none":
        problems.append(("train.optimizer.name", "DeepSpeed's Lion runs on GPUs (scaling.gpus_per_worker >= 1) or "
                         "as its CPU Lion with parallelism.offload_optimizer cpu; on CPU alone use AdamW, Adam or SGD"))
    return problems


def resize_refusal(spec: JobSpec, world_size: int) -> str | None:
    """Why a checkpoint written at another world size cannot load at `world_size` (None: it can)."""
    name = spec.train.optimizer.name
    if name in RESHARDABLE:
        return None
    return (f"cannot resume at {world_size} worker(s) from a checkpoint written at another world size: "
            f"train.optimizer {name}'s state does not convert to DeepSpeed's universal checkpoint (Adam's only); "
            "run the job at the world size that wrote it")


def no_function(ref: str, module: ModuleType) -> str:
    module_name, _, name = ref.partition(":")
    found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
    return f"cannot load {ref!r}: {module_name} has no function {name!r} (it has: {', '.join(found) or 'none'})"


# How Tidal calls each reference: (spec field, what the positional arguments are, the field of its keyword arguments)
CALLS = (("model.builder", ("model_spec",), "model.builder_args"),
         ("data.dataset", (), "data.dataset_args"),
         ("train.step_fn", ("model", "batch"), None))


def check_calls(spec: JobSpec, working_dir: Path) -> list[str]:
    """Refuse (SpecError) a spec whose user functions cannot take the arguments it gives them;
    the notes on what could not be checked here."""
    problems, notes = call_problems(spec, working_dir)
    if problems:
        raise SpecError(problems)
    return notes


def call_problems(spec: JobSpec, working_dir: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """(problems, notes): each user function the spec names, imported from `working_dir` as the
    workers import it, against the arguments Tidal will call it with. A problem names the field and
    what to change; a note says which reference could not be checked here."""
    problems: list[tuple[str, str]] = []
    notes: list[str] = []
    with _importable_from(working_dir):
        for field, positional, args_field in CALLS:
            section, key = field.split(".")
            ref = getattr(getattr(spec, section), key)
            if not ref:
                continue
            kwargs = getattr(getattr(spec, section), args_field.split(".")[1]) if args_field else {}
            module_name, _, name = ref.partition(":")
            try:
                module = importlib.import_module(module_name)
            except Exception as e:  # noqa: BLE001 - the user's module, which may need what only the workers have
                notes.append(f"{field} {ref!r} was not checked here: importing {module_name} failed "
                             f"({type(e).__name__}: {e}); the workers import it ({WHERE})")
                continue
            fn = getattr(module, name, None)
            if not callable(fn):
                problems.append((field, no_function(ref, module)))
                continue
            problem = bind_problem(ref, fn, positional, kwargs, field, args_field)
            if problem:
                problems.append((field, problem))
    return problems, notes


def bind_problem(ref: str, fn: Callable[..., Any], positional: tuple[str, ...], kwargs: dict[str, Any],
                 field: str, args_field: str | None) -> str | None:
    """Why `fn` cannot be called with `positional` (placeholders, by name) and `kwargs`; None if it can."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature Python can read: the workers will tell
        return None
    try:
        signature.bind(*positional, **kwargs)
        return None
    except TypeError as e:
        why = str(e)
    name = ref.partition(":")[2]
    call = f"{name}({', '.join([*positional, *(f'{k}=...' for k in kwargs)])})"
    given = f" (the keys of {args_field})" if kwargs and args_field else ""
    plain = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                              return_annotation=signature.empty)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in plain.parameters.values())
    unknown = [] if takes_any else [k for k in kwargs if k not in plain.parameters]
    fixes = [_fix(why, name, positional, field, args_field)]
    if unknown and "unexpected keyword argument" not in why:  # Python names one problem; say both
        fixes.append(_fix(f"unexpected keyword argument '{unknown[0]}'", name, positional, field, args_field, unknown))
    elif unknown:
        fixes = [_fix(why, name, positional, field, args_field, unknown)]
    return f"{ref!r} is {name}{plain}, which Tidal cannot call as {call}{given}: {why}; {'; and '.join(fixes)}"


def _fix(why: str, name: str, positional: tuple[str, ...], field: str, args_field: str | None,
         unknown: list[str] | None = None) -> str:
    """What to change, from Python's reason a call does not bind (`unknown`: all the keys it does not take)."""
    if unknown and "unexpected keyword argument" in why:
        them = ", ".join(unknown)
        return (f"remove {them} from {args_field}, or add {'a parameter' if len(unknown) == 1 else 'parameters'} "
                f"{them} to {name}()")
    if m := re.search(r"missing a required argument: '(\w+)'", why):
        where = f"give {m[1]} in {args_field}, or " if args_field else ""
        return f"{where}give {m[1]} a default in {name}()"
    if m := re.search(r"multiple values for argument '(\w+)'", why):
        return f"{args_field} sets {m[1]}, which {name}() takes as its {' or '.join(positional)}: rename one of them"
    if positional:
        return (f"{field} is called with {len(positional)} positional argument(s) ({', '.join(positional)}) first: "
                f"give {name}() parameters for them, e.g. def {name}({', '.join(positional)}"
                f"{', **kwargs' if args_field else ''})")
    return f"change {name}()'s parameters or {args_field} so that they match"


@contextmanager
def _importable_from(working_dir: Path) -> Iterator[None]:
    """The workers find the user's modules in the job's working directory (Ray puts it on their
    path); a `tidal` script's path does not hold it."""
    entry = str(working_dir.resolve())
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added:
            sys.path.remove(entry)
