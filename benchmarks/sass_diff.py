#!/usr/bin/env python3
# Compares the SASS of two `cuobjdump -sass` listings kernel by kernel (addresses and encodings
# stripped), mapping the production kernels' names at 69ce588 to today's (variant template
# arguments dropped, the parallel combine renamed; tuning-policy template arguments dropped on both
# sides; decode_attention_f32_kernel's trailing cache type float, which fp8 added, dropped).
# Prints IDENTICAL / DIFFERENT per kernel.
#   benchmarks/sass_diff.py [--same-names] BASE.sass HEAD.sass [NAME_SUBSTRING [LINES]]
# (last two: show a diff; --same-names: BASE is a later commit than 69ce588, no renames to map)
# benchmarks/build_cost.sh writes such listings when cuobjdump (and nvdisasm) are on PATH.
import re, subprocess, sys
def demangle(names):
    out = subprocess.run(['c++filt'], input='\n'.join(names), capture_output=True, text=True).stdout.split('\n')
    return out[:len(names)]
def parse(path):
    funcs = {}; cur = None; buf = []
    for line in open(path):
        m = re.match(r'\s*Function : (\S+)', line)
        if m:
            if cur: funcs[cur] = buf
            cur = m.group(1); buf = []; continue
        if cur is None: continue
        if line.startswith('\t\t.') or 'Fatbin' in line: continue
        l = re.sub(r'/\*[0-9a-f]{4,}\*/', '', line)       # addresses
        l = re.sub(r'/\* 0x[0-9a-f]+ \*/', '', l)           # encodings
        l = l.strip()
        if l: buf.append(l)
    if cur: funcs[cur] = buf
    names = list(funcs)
    return {d: funcs[n] for n, d in zip(names, demangle(names))}
def canon(d, is_base=False):
    d = re.sub(r', triattn::cuda::tuning::\w+::\w+(?=[,>])', '', d)  # the policy a kernel takes
    if is_base and not same_names:
        d = d.replace('decode_attention_combine_kernel<', 'decode_attention_combine_serial_kernel<')
        d = d.replace('decode_attention_combine_fast_kernel', 'decode_attention_combine_kernel')
    d = re.sub(r'(decode_attention_mma_pipe_kernel<[^>]*?), false, false>', r'\1>', d)
    d = re.sub(r'(decode_attention_f32_kernel<\d+, \w+, float), float>', r'\1>', d)  # cache type T = float
    d = re.sub(r'(score_mean_mma_kernel<.*?, true, 2), 8, 0>', r'\1>', d)
    d = re.sub(r'(score_max_mma_pipe_kernel<.*?, 8, 2, 1, (true|false)), 2, 32, true>', r'\1, 32>', d)
    d = d.split('>(')[0] + '>'  # parameter list
    return d
same_names = len(sys.argv) > 1 and sys.argv[1] == '--same-names'
if same_names: del sys.argv[1]
base = parse(sys.argv[1]); head = parse(sys.argv[2])
bmap = {}
for d, t in base.items(): bmap.setdefault(canon(d, True), []).append((d, t))
same = diff = missing = 0
for d, t in sorted(head.items()):
    c = canon(d)
    if c not in bmap:
        print('NO BASE   ', c); missing += 1; continue
    assert len(bmap[c]) == 1, bmap[c]
    bt = bmap[c][0][1]
    if bt == t: same += 1; print('IDENTICAL ', c, len(t))
    else:
        diff += 1
        n = sum(1 for a, b in zip(bt, t) if a != b) + abs(len(bt) - len(t))
        print('DIFFERENT ', c, 'base', len(bt), 'head', len(t), 'lines differing ~', n)
print(f'{same} identical, {diff} different, {missing} without a base kernel; base has {len(base)} kernels, head {len(head)}')
if len(sys.argv) > 3:
    import difflib
    for d, t in head.items():
        if sys.argv[3] in canon(d):
            bt = bmap[canon(d)][0][1]
            for l in list(difflib.unified_diff(bt, t, lineterm='', n=1))[:int(sys.argv[4]) if len(sys.argv) > 4 else 80]: print(l)
            break
