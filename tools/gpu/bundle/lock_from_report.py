"""lock_from_report.py REPORT BUNDLE_DIR IMAGE_PACKAGES -- lock lines for a bundle from pip's resolution.

REPORT is the JSON of  pip install --dry-run --ignore-installed --target X --report REPORT <platform
flags of prepare.sh> <the bundle's top requirements>  (pip resolves from PyPI metadata without
downloading the wheels). Walks the Requires-Dist (markers for CPython 3.12 on Linux x86_64) from the
requested packages and prints `name==version --hash=sha256:...  # file.whl` for each wheel reached,
and from those named in BUNDLE_DIR/carry.txt (also packages imported without being declared), not
descending into packages named in BUNDLE_DIR/pruned.txt (left out on purpose) nor into those the GPU
image holds (IMAGE_PACKAGES: their needs are the image's) unless carry.txt names them.
Split the output into the bundle's lock-<piece>.txt files by hand.
"""
import json
import os
import sys

from check_reqs import ENV, Requirement, canonicalize_name


def names(path):
    if not os.path.exists(path):
        return set()
    return {canonicalize_name(line.split()[0].split('==')[0]) for line in open(path)
            if line.strip() and not line.lstrip().startswith('#')}


report, bundle_dir, image_file = sys.argv[1:]
pruned = names(os.path.join(bundle_dir, 'pruned.txt'))
carry = names(os.path.join(bundle_dir, 'carry.txt'))
image = names(image_file) - carry
items = {canonicalize_name(i['metadata']['name']): i for i in json.load(open(report))['install']}
todo = [n for n, i in items.items() if i.get('requested') or n in carry]
kept = set()
while todo:
    name = todo.pop()
    if name in kept or name in pruned or name in image or name not in items:
        continue
    kept.add(name)
    meta = items[name]['metadata']
    for line in meta.get('requires_dist', []):
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**ENV, 'extra': x}) for x in
                                     [''] + (items[name].get('requested_extras') or [])):
            todo.append(canonicalize_name(req.name))
for name in sorted(kept, key=lambda n: list(items).index(n)):
    meta, info = items[name]['metadata'], items[name]['download_info']
    sha = info['archive_info']['hashes']['sha256']
    print(f"{meta['name']}=={meta['version']} --hash=sha256:{sha}  # {info['url'].rsplit('/', 1)[-1]}")
