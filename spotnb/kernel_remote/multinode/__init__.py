"""Distributed jobs: one cell on N spot nodes (and P processes per node), on torchrun's
elastic engine.

``%%spot_train --nodes 3:4`` keeps 4 instances in the job's capacity group; the cell
runs on every node as torchelastic workers (one IPython kernel per process), with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and the rest set as torchrun
sets them, so the user's DDP code runs unchanged. Training goes on with 3 nodes while
a lost node's replacement boots and re-forms at 4 when it joins.

Who does what (the invariants of ARCHITECTURE.md, generalised):

* **Node slots and leases.** Each node's agent holds the lease of one node slot
  (``lease.json``, ``lease.<k>.json``): exactly one agent per slot. Its epoch is its
  attempt and names its event stream (one writer per stream); slot k's epochs are
  k+1, k+1+N, ... so they are unique job-wide (:mod:`spotnb.protocol.lease`).
* **Rendezvous** (:mod:`.rendezvous`): torchelastic's c10d rendezvous (``min_nodes``,
  ``max_nodes``), its store hosted by one node's agent, named in ``rendezvous.json``; a
  lost host is replaced by a new generation (compare-and-swap in the job's store).
* **Workers** (:mod:`.elastic`, :mod:`.node`): torchelastic's ``SimpleElasticAgent``
  with kernels as workers, in each node's agent.
* **Checkpoints** (:mod:`spotnb.train.runtime`): every rank writes its shard of
  one DCP checkpoint; the coordinator (global rank 0) writes the manifest and moves
  ``LATEST`` after every rank's files are written (DCP gathers their write results),
  so a resume never reads a checkpoint that some rank did not finish. Every
  ``maybe_save`` agrees across ranks (one small all-reduce) on whether to save now:
  a notice on any node makes every rank save at the same step.
* **A node's notice**: the coordinated checkpoint; then the node's ranks park (its
  agent releases its slot and leaves) and the other ranks ask their agents to re-form:
  torchelastic restarts their workers in a new round without the node, from that
  checkpoint. The replacement joins later: the round re-forms at N.
* **A hard kill**: the peers' collectives fail (gloo at once; others within the peer
  timeout), or torchelastic drops the node when its rendezvous heartbeat stops: the
  survivors re-form from the last checkpoint.
* **Result**: the node of global rank 0 writes the outputs and the result.

Bounds on every wait on a peer (named below): the process groups' default timeout
(``Policy.peer_timeout``), the rendezvous store's read timeout (the same), the
heartbeat (KEEP_ALIVE_SECONDS x KEEP_ALIVE_MISSES), the join timeout, the exit barrier.
"""

from __future__ import annotations

#: torchelastic's role name for the workers.
ROLE = "trainer"
#: How often the node's elastic agent looks at its workers and asks the rendezvous
#: store whether a node waits to join (TCP within the cluster: no cost).
MONITOR_SECONDS = 0.5
#: The rendezvous heartbeat: each node's agent writes one every KEEP_ALIVE_SECONDS;
#: after KEEP_ALIVE_MISSES missed ones the node is dropped from the round (a hard-killed
#: node is noticed within 3 s even if no collective of its peers fails).
KEEP_ALIVE_SECONDS = 1
KEEP_ALIVE_MISSES = 3
#: Once MIN nodes are in a round, how long it waits for more before it starts below
#: MAX (torchelastic's last call; its default is 30 s: a shrink would cost that much).
LAST_CALL_SECONDS = 2
#: A node waits to join: the runtimes are asked for a coordinated save first (so the
#: join redoes no step); a cell that saves nothing within this re-forms without it.
JOIN_SAVE_SECONDS = 60.0
#: A rendezvous that cannot complete within this (fewer than MIN nodes) ends the
#: elastic run; the node looks at the rendezvous record and waits again, until the job
#: ends (stop, budget, deadline): waiting for capacity, like a single-node job.
JOIN_TIMEOUT_SECONDS = 600
#: torchelastic's restart budget within one generation. Membership changes (a node
#: joins) cost none; each re-formation after a lost peer costs one. A job that loses
#: this many rounds in a row to failures fails.
MAX_REFORMATIONS = 10_000
#: After the last cell finished, how long a node waits for the others at torchelastic's
#: exit barrier (their last uploads).
EXIT_BARRIER_SECONDS = 600
#: A node whose workers finished waits at most this long for the node of global rank 0
#: to write the result before it exits.
RESULT_WAIT_SECONDS = 60.0
#: Pause before looking at the rendezvous again after an elastic run failed.
RETRY_SECONDS = 0.5
