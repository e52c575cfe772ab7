"""Benchmarks of the PGAS sharding types against TorchRec's own, side by side in one
process group (``python -m torchrec_pgas.benchmark``, see ``__main__``), and a soak
(``python -m torchrec_pgas.benchmark.soak``)."""

import os
import sys

import torch.distributed as dist


def finish() -> None:
    """Leaves the process group, then the process without interpreter teardown: gloo's
    threads have aborted finished runs there ("terminate called without an active
    exception"), which torchrun reports as a failed job."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
