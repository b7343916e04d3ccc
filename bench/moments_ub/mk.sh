#!/bin/bash
# mk.sh: builds drv.cpp with kernel variants, each from its own csrc/ copy (AVX2 flags, the
# build's -O3 -ffp-contract=off). Usage: bench/moments_ub/mk.sh OUT name:CSRC_DIR[:extra flags] ...
#   a name ending in 512 gets the AVX-512 kernels (setup.py's flags, -DVISA=Avx512ISA)
#   e.g. git archive main | tar -x -C /tmp/old; mk.sh /tmp/drv old:/tmp/old/csrc new:$PWD/csrc
# Run the result on an otherwise idle CPU: its figures are cycle counts.
set -e
out=$1; shift
here=$(cd "$(dirname "$0")" && pwd)
inc=$(mktemp -d); mkdir -p $inc
echo -n > $inc/vars.inc; objs=""
decl=""; arr=""
for spec in "$@"; do
  IFS=: read name dir flags <<< "$spec"
  case $name in *512) flags="$flags -mavx512f -mavx512bw -mavx512vl -mavx512dq -Wno-maybe-uninitialized -DVISA=Avx512ISA";; esac
  g++ -std=c++17 -O3 -ffp-contract=off -fno-math-errno -mavx2 -mfma -mf16c -I$dir $flags -DVN=$name -c $here/var.cpp -o $inc/$name.o &
  decl="$decl namespace offload { void ${name}_q(const AdamQTask&, const AdamScalars&, int64_t, int64_t); void ${name}_f(const AdamTask&, const AdamScalars&, int64_t, int64_t); }"
  arr="$arr {\"$name\", offload::${name}_q, offload::${name}_f},"
  objs="$objs $inc/$name.o"
done
wait
echo "$decl" > $inc/vars.inc
echo "struct Var { const char* name; QF q; FF f; } VARS[] = { $arr };" >> $inc/vars.inc
g++ -std=c++17 -O2 -I$here/../../csrc -I$inc $here/drv.cpp $objs -o $out -pthread
rm -rf $inc
