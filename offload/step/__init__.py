"""step/: HOW ONE STEP RUNS: the bucket pipeline, the registry of which parameter has state, the
task-table rows, and the engine that composes a state tier (offload/state/) with a parameter side
(offload/params/)."""
