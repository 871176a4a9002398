"""`torchrun` without its teardown: `python -m shardlab.runner.agent [torchrun options] program ...`.

Every option means what it means to torchrun: the parser, the rendezvous and the elastic agent are
torch's own (`torch.distributed.run`). The one difference: once the ranks have finished and been
reported, the agent exits at once instead of tearing down torch's modules in the interpreter (about
0.6 s on a small CPU, paid by every launch of the study; docs/measurements.md, "Launch cost"). A failure still
raises, and exits, exactly as torchrun does. And a lone node's static rendezvous endpoint `ANY_PORT` gets a
free port here, just before the agent binds it: torch's static rendezvous tells the ranks the port it was
given, so port 0 would leave them dialling port 0.

On CPU the agent itself and every rank are forked by the rank server (`shardlab.runner.rank_server`),
which has imported torch, this module and the worker once; torch's own forkserver start method was
tried first and saved nothing on 2 cores (docs/measurements.md, "Launch cost").
"""

from __future__ import annotations

import os
import sys
import time


ANY_PORT = "localhost:0"


def with_free_port(argv: list[str]) -> list[str]:
    from torch.distributed.elastic.utils.distributed import get_free_port

    return [f"--rdzv-endpoint=localhost:{get_free_port()}" if arg == f"--rdzv-endpoint={ANY_PORT}" else arg
            for arg in argv]


def main(argv: list[str]) -> None:
    import torch.distributed.run as torchrun

    os.environ["SHARDLAB_AGENT_T"] = repr(time.time())  # the ranks' launch-cost breakdown starts here
    torchrun.main(with_free_port(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the ranks are done and reported; skip tearing down torch's modules
