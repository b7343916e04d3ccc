"""params/: WHERE THE PARAMETERS AND GRADIENTS LIVE. ``host`` (CPU tensors, FSDP2 local shards on the
CPU) and ``device`` (parameters on an ``offload.device.Device``: CUDA, or CpuDevice/FakeDevice in
tests). A side turns the pieces of a bucket into kernel pointers; it never sees where the state
lives (offload/state/)."""
