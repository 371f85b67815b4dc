# SPDX-License-Identifier: Apache-2.0
"""triattn: TriAttention KV-cache compression for inference engines (docs/python.md).

numpy arrays run the CPU path; CUDA tensors (torch, CuPy) run the kernels on the caller's
current stream when the extension was built with CUDA (``triattn.has_cuda``).
"""
from ._triattn import *  # noqa: F401,F403
from ._triattn import has_cuda  # noqa: F401

__version__ = "0.1.0"
