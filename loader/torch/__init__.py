"""Torch: the ``IterableDataset`` layer over a stream (``dataset``, ``mixdataset``, ``layer``),
what crosses from DataLoader workers (``batch``, ``arena``, ``assemble``, ``scatter``,
``output``), epoch counting and resume across processes (``epochs``, ``stream``), and the
guards and process ties of workers (``guards``, ``lifeline``). The only part of
``loader`` that imports torch.

(This package is ``loader.torch``; inside it ``import torch`` is still PyTorch: imports are
absolute.)
"""
