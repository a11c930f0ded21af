"""Test-session settings.

The tests run tiny models whose ops take microseconds: one intra-op thread is faster than two
and, on a loaded 2-core machine, avoids OpenMP threads spinning against each other (measured:
a tiny Flux step took 6-9 s with 2 threads under load, well under 1 s with 1).
"""

import torch

torch.set_num_threads(1)
