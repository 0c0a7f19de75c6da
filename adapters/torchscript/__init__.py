"""TorchScript models (``platform: "pytorch_libtorch"``, ``model.pt``)."""
