# The hot token loop of each dispatch_kernel instance in `cuobjdump -sass` output (docs/perf.md 32): instructions up
# to the first predicated EXIT after the loop (the cold-pass check), local-memory accesses in and after it, and
# S2R reads of SR_TID in it. Usage: python3 sass_hot_path.py SASS.txt
import re,sys
for f in open(sys.argv[1]).read().split('Function :')[1:]:
    name=f.split('\n',1)[0].strip()
    if 'dispatch_kernel' not in name: continue
    ins=[m.group(1).strip() for m in re.finditer(r'/\*[0-9a-f]{4,}\*/\s*(.*?);',f)]
    # hot part: up to the last EXIT before the first RET / the cold subroutine start: use index of first 'EXIT' after last BAR preceding 'CALL.REL.NOINC' to cold
    ex=[i for i,s in enumerate(ins) if s.endswith('EXIT') and s.startswith('@') and i>500]
    end=ex[0] if ex else len(ins)
    loc=[i for i,s in enumerate(ins) if re.search(r'\b(STL|LDL)\b',s)]
    s2r=sum(1 for s in ins[:end] if 'SR_TID' in s)
    m=re.search(r'dispatch_kernelI(.*?)EEv',name).group(1)
    print(m, 'total',len(ins),'hot',end,'local in hot',sum(1 for i in loc if i<end),'local after',sum(1 for i in loc if i>=end),'S2R tid hot',s2r)
