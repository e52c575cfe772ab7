"""Benchmarks of the PGAS sharding types against TorchRec's own, side by side in one
process group (``python -m torchrec_pgas.benchmark``, see ``__main__``), and a soak
(``python -m torchrec_pgas.benchmark.soak``)."""
