"""pipes.py: which AVX2 ops issue for free beside the divider on this core (8-bit moment loop).

Writes pipes.cpp: loops of one vsqrtps + one vdivps (independent) + K independent ops of one
kind; core cycles per iteration (TSC x the core/TSC clock ratio 1.248 measured on an AMD
EPYC Zen 3; adjust for yours). Build: g++ -O1 -mavx2 pipes.cpp -o pipes; run it on an otherwise idle CPU.
On AMD EPYC Zen 3: shifts, pshufb, mul, add, cvt, and, pack, blendv: K=12 costs nothing
over the divider pair; pmovzx ymm and vpermq (cross-lane) ~1.25 cycles each.
"""
import sys
kinds = {
 'none': None,
 'shift': 'vpslld $1, %ymm{r}, %ymm{r}',
 'shuf': 'vpshufb %ymm15, %ymm{r}, %ymm{r}',
 'mul': 'vmulps %ymm14, %ymm{r}, %ymm{r}',
 'add': 'vaddps %ymm14, %ymm{r}, %ymm{r}',
 'cvt': 'vcvtdq2ps %ymm{r}, %ymm{r}',
 'and': 'vpand %ymm14, %ymm{r}, %ymm{r}',
 'pack': 'vpackssdw %ymm15, %ymm{r}, %ymm{r}',
 'pmovz': 'vpmovzxbd %xmm15, %ymm{r}',
 'blendv': 'vpblendvb %ymm13, %ymm15, %ymm{r}, %ymm{r}',
 'perm': 'vpermq $0xd8, %ymm{r}, %ymm{r}',
}
src = ['#include <x86intrin.h>', '#include <cstdio>', '#include <cstdint>', 'int main(){']
for name, op in kinds.items():
    for k in ([0] if op is None else [4, 8, 12, 16]):
        body = ['vsqrtps %ymm0, %ymm1', 'vdivps %ymm2, %ymm3, %ymm4']
        regs = [5,6,7,8,9,10,11,12]
        for i in range(k):
            body.append(op.format(r=regs[i % 8]))
        # 4 copies per loop iteration
        asm = ('\\n'.join(body) + '\\n').replace('%', '%%')
        src.append('{ uint64_t best=~0ull; for(int r=0;r<7;r++){ long n=2000000; uint64_t t0=__rdtsc();')
        src.append('asm volatile("vxorps %%ymm0,%%ymm0,%%ymm0\\n vmovaps %%ymm0,%%ymm2\\n vmovaps %%ymm0,%%ymm3\\n vpcmpeqd %%ymm14,%%ymm14,%%ymm14\\n vpxor %%ymm15,%%ymm15,%%ymm15\\n vpxor %%ymm13,%%ymm13,%%ymm13\\n 1:\\n' + asm + ' sub $1,%0\\n jnz 1b" : "+r"(n) :: "memory");')
        src.append('uint64_t t=__rdtsc()-t0; if(t<best)best=t;} printf("%%-7s k=%%2d  core cycles/iter %%.2f\\n", "%s", %d, best*1.248/2e6); }' % (name, k))
src.append('}')
open('pipes.cpp','w').write('\n'.join(src))
