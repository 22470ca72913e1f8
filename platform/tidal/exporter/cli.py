"""`tidal export`: argument parsing and printing only; the work is `tidal.exporter.model.export`.

Importing this module loads no torch, ray or deepspeed (`tidal --help` stays fast).
"""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  tidal export jobs/tiny-hf-llama.yaml --format hf --output out/llama     # the latest checkpoint
  tidal export jobs/quickstart.yaml --checkpoint 80 --format torch --output out/gpt
  tidal export jobs/quickstart.yaml --format hf --output out/gpt2         # the built-in GPT as GPT-2
  tidal export jobs/quickstart.yaml --format torch --output out/gpt --mlflow --register quickstart-gpt

SPEC is the job file the job ran with (and the same --set overrides): its name and
checkpoint.storage (or $TIDAL_STORAGE) say where the checkpoints are, local or s3://...; only the
chosen step's files are downloaded. The ZeRO 1-3 or pipeline shards are merged on this machine
(CPU only, no Ray), into fp32 master weights.

formats:
  hf     a Hugging Face save_pretrained folder (safetensors, config.json, and the job's
         data.tokenizer if it had one): transformers.AutoModelForCausalLM.from_pretrained(DIR).
         Hugging Face jobs keep their architecture; the built-in GPT becomes GPT-2 (exact).
  torch  model.safetensors + tidal-model.json: tidal.load_exported(DIR) rebuilds the model the job
         trained, with torch alone; its forward(tokens, targets) returns the loss.

--mlflow logs the model on the job's own MLflow run: transformers flavour for hf when the job had a
tokenizer (MLflow's pipeline needs one), else pytorch flavour; --register NAME also registers it
as a new version of model NAME.

exit codes: 0 exported; 2 bad arguments, no such job or checkpoint (nothing written; the message
says what exists); 1 a checkpoint that cannot be read or an MLflow store that cannot be reached."""
JSON_FIELDS = "job, output, format, step, checkpoint, mlflow_run_id, model_uri, registered"


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `export` command to `tidal`'s subcommands."""
    help_ = "consolidate a job's checkpoint into one model (Hugging Face or torch), optionally logged to MLflow"
    p = subparsers.add_parser("export", help=help_, description=help_, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="SPEC", help="the job's spec YAML file (e.g. jobs/quickstart.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="the overrides the job ran with, e.g. --set checkpoint.storage=s3://bucket/runs (repeatable)")
    p.add_argument("--checkpoint", default="latest", metavar="latest|best|STEP",
                   help="which complete checkpoint: latest (default), best (lowest eval_loss, or the job's "
                   "checkpoint.keep_best metric) or a step number")
    p.add_argument("--format", required=True, choices=["hf", "torch"], help="hf: save_pretrained folder; "
                   "torch: safetensors + config for tidal.load_exported (see below)")
    p.add_argument("--output", required=True, metavar="DIR",
                   help="folder to write: new or empty (an earlier export there is replaced)")
    p.add_argument("--mlflow", action="store_true", help="log the model on the job's MLflow run")
    p.add_argument("--register", metavar="NAME", help="register it in MLflow's model registry as NAME (implies --mlflow)")
    p.add_argument("--json", action="store_true", help=f"print one JSON object on stdout: {JSON_FIELDS}")
    p.set_defaults(func=_export)
    return p


def _export(args: argparse.Namespace) -> int:
    from tidal.exporter.model import export
    from tidal.output import print_json, print_notes
    from tidal.spec.job import notes
    from tidal.spec.load import load_spec

    spec = load_spec(args.spec, args.overrides)
    print_notes(notes(spec))
    result = export(spec, checkpoint=args.checkpoint, format=args.format, output=args.output, mlflow=args.mlflow,
                    register=args.register)
    if args.json:
        print_json(result.record())
    else:
        print(result.summary())
    return 0
