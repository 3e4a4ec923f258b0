"""raytpu: Ray-orchestrated distributed training for PyTorch on TPU, GPU and CPU."""

__version__ = "0.1.0"
