# _version.py: the single source of the package version (setup.py bakes it into offload._C).
__version__ = "0.1.0"
