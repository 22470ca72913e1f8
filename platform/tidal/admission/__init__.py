"""The team queue: who runs on a shared cluster, with how many workers, and why the rest wait.

One feature, one package; its modules, from the rules up to the tools:
- `quotas`: the cluster's quota file (teams, shares, priorities, defaults);
- `decision`: the decision's values (the jobs it is made about, what it decides for each);
- `plan`: the decision being built, each job's workers after it;
- `policy`: the pure decision (`decide`): admit, shrink, grow, suspend, and why each job waits;
- `cloud`: every job's cloud burst summed into one autoscaler request, within each team's budget;
- `queue_doc`: the durable queue document the decisions are saved to;
- `registration`: a driver's registration, checked as untrusted input;
- `parking`: a waiting job parks instead of holding a driver, and is started once admitted;
- `relaunch`: after a head restart, the queue's jobs start again by themselves;
- `gauges`: the queue's Prometheus gauges, per team;
- `actor`: the one detached Ray actor on the head that decides, saves and answers;
- `naming`: how a job and its tools name admission (the actor, a job's key, where the queue lives);
- `handle`: how drivers, workers and the CLI reach the actor;
- `seat`: a job's driver registering, waiting while QUEUED, checking in while it runs;
- `view`: what `tidal queue` shows.

Importing this package imports neither ray nor torch (docs/sharing.md).
"""
