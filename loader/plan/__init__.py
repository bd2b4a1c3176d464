"""Plan: what each rank and worker reads, and in which order. Pure; no I/O, no torch.

The epoch order (``order``), its cut into one piece per (rank, worker) (``partition``), read
windows and their seeded orders (``windows``), the byte ranges a worker will read
(``reads``), class-weight draws (``reweight``), the rest of an interrupted epoch re-split over
another world (``elastic``) and the resume state (``state``). Everything here is a function
of the manifest's counts and the options: every process computes the same plan without
talking to the others. Imports nothing from the rest of ``loader`` but ``loader.errors``.
"""
