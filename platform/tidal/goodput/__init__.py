"""Where a job's wall time went: the goodput ledger (pure functions, no Ray, no MLflow).

`account.fold(state, entry)` takes the job's events one by one (the entries of its durable event
log, tracking/buffer.py) and puts every second since the job's first launch in exactly one
bucket (`account.BUCKETS`); `account.finish(state, now)` closes the account at the job's end.
`report` turns a state into the end summary's line, MLflow metrics and a table. The tracker's
ledger (tracking/ledger.py) feeds it as it reads the log and keeps the state in its mark.
"""
