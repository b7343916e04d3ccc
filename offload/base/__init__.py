"""base/: the leaves of offload. Nothing here imports another offload module.

``units`` (byte sizes: ``parse_size``, ``human``), ``memory`` (4 KiB-aligned host memory), ``dist``
(the few torch.distributed / DTensor facts), ``trace`` (the optional Chrome-trace timeline). Every
other package may import from here; this package imports only the standard library, numpy and
torch.
"""
