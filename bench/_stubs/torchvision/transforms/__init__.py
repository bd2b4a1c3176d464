"""Stub package for ``torchvision.transforms``."""
