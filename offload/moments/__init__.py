"""moments/: the only package that knows how compressed Adam moments are stored.

``format`` describes each format ("bf16", "8bit"): which tensors it has, their dtypes, whether a
tensor has one entry per element or per block, the saved keys of a checkpoint, and the encoder /
decoder used by state_dict, load_state_dict and the checkpoints. The kernel that steps them is in
offload/native/moments.py. ``compressed`` is their ``opt.state`` face (the compressed tensors read out
of a state tier, decoded to torch's fp32 layout) and ``handouts`` the decoded moments a caller holds.
"""
