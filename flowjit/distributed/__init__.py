"""flowjit on many processes and machines (Ray): clusters of tasks, parameter-server training.

    from flowjit import distributed as fd
    with fd.Cluster({"ps": 2, "worker": 3}) as cluster:
        ...   # fj.device("/job:ps/task:0") places ops and Variables on tasks
        trainer = fd.Trainer(cluster, loss_fn, params, fj.optim.Adam(1e-3), mode="sync", replicas_to_aggregate=2)
        history = trainer.fit(batches, steps=500)

Needs the `distributed` extra (Ray); importing this package does not import Ray. docs/distributed.md
says how a step runs across tasks, what travels and how failures are recovered.
"""

from flowjit.distributed.cluster import Cluster
from flowjit.distributed.trainer import History, Trainer, shard_by_size

__all__ = ["Cluster", "History", "Trainer", "shard_by_size"]
