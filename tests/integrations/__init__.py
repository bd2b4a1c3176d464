"""The loader inside real training stacks: Lightning, accelerate, torchrun, torchdata."""
