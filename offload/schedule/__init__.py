"""schedule/: when the buckets of device (GPU) parameters are stepped: during backward by a CPU
worker thread, in ``step()``, or one step late; plus the uploads of new weights and the small
parameters stepped on the device. Every bucket is stepped by the engine's one body
(offload/engine/bucket.py)."""
