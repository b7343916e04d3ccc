// python_module.cpp: the Python-facing sources of offload._C, compiled as one translation unit.
// Each of them includes pybind11, whose headers alone cost ~6-7 s of compiler time per translation
// unit; compiled together the four take ~19 s instead of ~39 s as four units (GCC 12, AMD Zen 3).
// They stay separate files, one responsibility each (their headers say what they trust); setup.py
// compiles them only through here, so names in their anonymous namespaces must not collide.
#include "bindings.cpp"          // the module: kernel entries, ISA and thread settings
#include "aio_bindings.cpp"      // the NVMe state I/O engine
#include "moments_bindings.cpp"  // compressed-moment kernel entry
#include "rows.cpp"              // the optimizer's per-step row check (collect_rows, state_rows)
