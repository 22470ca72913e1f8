"""The team queue: who runs on a shared cluster, with how many workers, and why the rest wait.

One feature, one package:
- `quotas`: the cluster's quota file (teams, shares, priorities, defaults);
- `policy`: the pure decision (`decide`): admit, shrink, grow, suspend, and why each job waits;
- `cloud`: every job's cloud burst summed into one autoscaler request;
- `queue_doc`: the durable queue document the decisions are saved to;
- `actor`: the one detached Ray actor on the head that decides, saves and answers;
- `seat`: a job's driver registering, waiting while QUEUED, checking in while it runs;
- `directive`: rank 0's poll of the size admission gives the job;
- `view`: what `tidal queue` shows.

Importing this package imports neither ray nor torch (docs/sharing.md).
"""
