"""Read: shard bytes made into samples. No torch.

``reader`` checks each shard's index and reads a piece's bytes (through ``loader.io``);
``chunk`` hands its samples out, each checked against its checksum; ``samples`` walks a
worker's windows in their seeded orders under the error policy; ``decode``, ``output`` and
``npbatch`` turn samples into decoded values and NumPy batches. Imports ``loader.plan`` and
``loader.io``.
"""
