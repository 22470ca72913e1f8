"""The worker group's health: what a fault or a signal does to the group, and who finds it.

- `decide`: the one pure decision: for admission's word, a straggler's node, a node that hung twice,
  a node back, a lost worker or a hang, what happens (wait, restart, shrink, avoid a node) and the
  group's size;
- `nodes`: rank 0's asks about the group's nodes, each that decision carried out;
- `directive`: rank 0's poll of the size the cluster's admission gives the job;
- `avoidance`: the group's record of a node it avoids, and its one writer;
- `stragglers`: which rank holds the others back (pure);
- `watchdog`: the step deadline and the phases outside steps;
- `hang`: a hung group explained through the job's storage before it ends;
- `stacks`: where a process is, read from inside or from outside.
"""
