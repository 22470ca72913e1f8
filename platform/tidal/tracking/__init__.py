"""MLflow tracking: one run per job, kept across restarts, each metric once per step."""
