"""Triton kernels that issue NVSHMEM puts, gets and signals (installed as
``torchrec_pgas.kernels``)."""
