"""cuda_stubs.py SITE... OUT -- build stand-in CUDA libraries so a CUDA bundle imports on a CPU machine.

Runs on the CPU machine only (local_check.sh); nothing of it travels to the GPU machine.
For every shared library under the SITE folders, collects the libraries it needs that neither the
SITEs nor the system provide (libcudart.so.13, libcuda.so.1, ...), and writes into OUT one stub per
missing SONAME: it defines every symbol the SITEs import from it, under the same symbol versions,
as a function returning a CUDA error code (100 = no device), so the dynamic loader accepts the
libraries and `torch.cuda.is_available()` is False. Needs readelf and cc.
"""
import collections, os, re, subprocess, sys

sites, out = sys.argv[1:-1], sys.argv[-1]
os.makedirs(out, exist_ok=True)

libs = [os.path.join(d, f) for s in sites for d, _, fs in os.walk(s) for f in fs
        if re.search(r'\.so(\.\d+)*$', f) and not os.path.islink(os.path.join(d, f))]
provided = {os.path.basename(p) for p in libs}
# unversioned imports name no library: give them to a stub by prefix (torch binds some at load)
PREFIX = [('cusparseLt', 'libcusparseLt.so'), ('cusparse', 'libcusparse.so'), ('cublasLt', 'libcublasLt.so'),
          ('cublas', 'libcublas.so'), ('cusolver', 'libcusolver.so'), ('cufft', 'libcufft.so'),
          ('cuFile', 'libcufile.so'), ('curand', 'libcurand.so'), ('cudnn', 'libcudnn.so'),
          ('nccl', 'libnccl.so'), ('nvshmem', 'libnvshmem_host.so'), ('nvrtc', 'libnvrtc.so'),
          ('nvJitLink', 'libnvJitLink.so'), ('cuda', 'libcudart.so'), ('cu', 'libcuda.so')]
needed, versions = set(), collections.defaultdict(set)   # soname -> {(symbol, version)}
unversioned = set()
for lib in libs:
    dyn = subprocess.run(['readelf', '-dW', lib], capture_output=True, text=True).stdout
    needed |= set(re.findall(r'\(NEEDED\).*\[(.+)\]', dyn))
    # version needs: which version names come from which file
    vn = subprocess.run(['readelf', '-VW', lib], capture_output=True, text=True).stdout
    owner, file_of = None, {}
    for line in vn.splitlines():
        m = re.search(r'File: (\S+)', line)
        if m:
            owner = m.group(1)
        m = re.search(r'Name: (\S+)', line)
        if m and owner:
            file_of[m.group(1)] = owner
    syms = subprocess.run(['readelf', '-W', '--dyn-syms', lib], capture_output=True, text=True).stdout
    for line in syms.splitlines():
        f = line.split()
        if len(f) >= 8 and f[6] == 'UND' and '@' not in f[7]:
            unversioned.add(f[7])
        if len(f) >= 8 and f[6] == 'UND' and '@' in f[7]:
            name, ver = re.split(r'@+', f[7])[:2]
            ver = ver.split()[0]
            if ver in file_of:
                versions[file_of[ver]].add((name, ver))


def on_system(soname):
    return subprocess.run(['sh', '-c', f'ldconfig -p | grep -q "{soname} "']).returncode == 0


missing = sorted(n for n in needed if re.match(r'lib(cu|nv|nccl)', n) and n not in provided and not on_system(n))
for soname in missing:
    syms = sorted(versions.get(soname, ()))
    stem = soname.split('.so')[0] + '.so'
    for name in unversioned:
        owner = next((lib for pre, lib in PREFIX if name.startswith(pre)), None)
        if owner == stem and not any(n == name for n, _ in syms):
            syms.append((name, None))
    by_ver = collections.defaultdict(list)
    for name, ver in syms:
        if ver:
            by_ver[ver].append(name)
    c = os.path.join(out, soname + '.c')
    vs = os.path.join(out, soname + '.map')
    with open(c, 'w') as fc:
        for name, _ in syms:
            fc.write(f'int {name}(void) {{ return 100; }}\n')
    with open(vs, 'w') as fv:
        for ver, names in by_ver.items():
            fv.write(ver + ' { global: ' + ' '.join(n + ';' for n in names) + ' };\n')
        if not by_ver:   # GNU ld takes one anonymous node or named ones; unnamed symbols stay global
            fv.write('{ global: *; };\n')
    subprocess.run(['cc', '-shared', '-fPIC', '-o', os.path.join(out, soname), f'-Wl,-soname,{soname}',
                    f'-Wl,--version-script={vs}', c], check=True)
    print(f'stub {soname}: {len(syms)} symbols')
