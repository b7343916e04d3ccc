"""optim/: the torch.optim contract: ``offload.Adam`` / ``offload.AdamW`` (adam.py), their argument
checks and options, gradient clipping, ``state_dict`` in torch's layout, the parameters torch's own
code steps, and how the optimizer builds its engine and, for GPU parameters, its device
schedule."""
