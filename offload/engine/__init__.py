"""engine/: how one optimizer step runs, for every state tier, parameter side and moment format:
the engine that composes a state tier (offload/state/) with a parameter side (offload/params/), the
one per-bucket body and its inline loop, and the torch-layout views of the state
(``opt.state``)."""
