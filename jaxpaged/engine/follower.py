"""A follower process of a multi-process engine (`jaxpaged serve --nnodes N --node-rank K`, K > 0):
it holds its devices' shards and runs the steps process 0 schedules, and serves nothing."""

import logging

from jaxpaged.engine.setup import start_device_worker
from jaxpaged.engine_args import EngineArgs, EngineArgsError
from jaxpaged.engine_config import EngineConfig
from jaxpaged.parallel.multihost import StepChannel, follow

logger = logging.getLogger("jaxpaged")


def run_follower(args: EngineArgs) -> int:
    """Starts the devices like the leader (same model, plan and programs), then runs its steps
    until it stops; returns the number of steps run.

    Raises:
      EngineArgsError: `node_rank` is 0 (process 0 is the engine itself).
    """
    if args.node_rank == 0:
        raise EngineArgsError("node_rank", 0, "process 0 runs the engine (LLM or jaxpaged serve), not a follower")
    worker = start_device_worker(EngineConfig.resolve(args))
    logger.info("process %d of %d ready; following process 0", args.node_rank, args.nnodes)
    return follow(worker.runner, StepChannel())
