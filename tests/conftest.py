"""Settings for the test process itself: one intra-op thread, as every rank the tests start has.

The references and judgements computed here are tiny-tensor work, where a second
OpenMP thread only adds synchronisation: with both cores busy (ranks, another
job) a 7-wide LayerNorm took 2-4 ms on two threads against 20 us on one.
"""

import torch

torch.set_num_threads(1)
