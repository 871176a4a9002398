"""`torchrun` without its teardown: `python -m shardlab.runner.agent [torchrun options] program ...`.

Every option means what it means to torchrun: the parser, the rendezvous and the elastic agent are
torch's own (`torch.distributed.run`). The one difference: once the ranks have finished and been
reported, the agent exits at once instead of tearing down torch's modules in the interpreter (about
0.6 s on a small CPU, paid by every launch of the study; docs/measurements.md, "Launch cost"). A failure still
raises, and exits, exactly as torchrun does.

Forking the ranks from a server that has already imported torch and transformers (torch's
`start_method="forkserver"` with a function entry point) was tried as a way to cut the ~2.5 s each
rank spends importing transformers' GPT-NeoX: on 2 cores it gave no clear saving (two ranks import
in parallel there anyway: 5.6-8.0 s a launch against 7.3-8.2 s without it), and 2 launches of 11
hung after training, so ranks start as torchrun starts them.
"""

from __future__ import annotations

import os
import sys
import time


def main(argv: list[str]) -> None:
    import torch.distributed.run as torchrun

    os.environ["SHARDLAB_AGENT_T"] = repr(time.time())  # the ranks' launch-cost breakdown starts here
    torchrun.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the ranks are done and reported; skip tearing down torch's modules
