"""slim_wheel.py PATTERNS SRC DST -- copy a wheel without files an H200 (sm_90) offline run never loads.

PATTERNS is a bundle's slim.txt: one regular expression a line, matched against a member's whole
path ('#' lines are comments). The dropped files are also removed from RECORD, so pip installs the
result as a normal wheel. Every kept entry is re-deflated with this Python's zlib (the code that made
the GPU-tested vllm parts; the same Python and zlib give byte-identical wheels).
"""
import csv, io, os, re, sys, zipfile

patterns, src, dst = sys.argv[1:]
lines = [l.strip() for l in open(patterns) if l.strip() and not l.lstrip().startswith('#')]
DROP = re.compile('^(' + '|'.join(lines) + ')$')
tmp = dst + '.tmp'
dropped = []
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, 'w', zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if DROP.match(info.filename):
            dropped.append(info.filename)
            continue
        data = zin.read(info)
        if info.filename.endswith('.dist-info/RECORD'):
            rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and not DROP.match(r[0])]
            buf = io.StringIO()
            csv.writer(buf, lineterminator='\n').writerows(rows)
            data = buf.getvalue().encode()
        zout.writestr(info, data, compress_type=info.compress_type)
os.replace(tmp, dst)
print(f'   slimmed {os.path.basename(src).split("-")[0]}: dropped {len(dropped)} files')
