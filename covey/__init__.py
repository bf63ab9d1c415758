"""covey: low-communication training of PyTorch models on decentralized compute."""

__version__ = "0.1.0"
