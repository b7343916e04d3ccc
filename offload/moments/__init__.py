"""moments/: how Adam's moments are stored: the formats, and the opt.state views of compressed
ones.

``format`` holds the formats as objects (``MomentFormat``, fp32 one of them) and ``moment_format``,
the factory that builds them from the ``moments=`` string: which tensors a format has, their
dtypes, whether a tensor has one entry per element or per block, the native kernel entry that
steps a bucket and its task-table columns, the saved keys of a checkpoint, and the encoder /
decoder used by state_dict, load_state_dict and the checkpoints. ``compressed`` is the
``opt.state`` views of the compressed formats (their tensors read out of a state tier, decoded to
torch's fp32 layout) and ``handouts`` the decoded moments a caller holds.
"""
