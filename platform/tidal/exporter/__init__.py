"""`tidal export` (the package is not named `export`: that is the SDK function `tidal.export`): a job's DeepSpeed checkpoint as one model (Hugging Face or torch) on a CPU machine.

model.py chooses the checkpoint and writes the folder; weights.py merges ZeRO shards or pipeline
stages; save.py and gpt2.py write the formats; mlflow.py logs and registers; cli.py is the command.
"""
